"""Map or refuse, field by field: every field of our config and of transformers' config class of each family either
converts to the same function (logits within 1e-4) or is refused with a line naming it and its value."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.models import randomized

from megatransformer.checkpoint import HOW_NOT_WHAT, write_weights_checkpoint
from megatransformer.cli import main
from megatransformer.config import ModelConfig, RunConfig
from megatransformer.hf import (
    DEEPSEEK_V3,
    FAMILIES,
    GPT2,
    IGNORED_KEYS,
    LLAMA,
    MISTRAL,
    QWEN3,
    load_hf_dir,
    save_hf_dir,
)
from megatransformer.inference import load_for_inference
from megatransformer.model import build_model

transformers = pytest.importorskip("transformers")  # a test dependency: `pip install -e .[test]`

LENGTH = 24  # positions compared: beyond the windows and the original contexts below
IDS = torch.randint(0, 90, (2, LENGTH), generator=torch.Generator().manual_seed(1))

# ------------------------------------------------------------------------------------------ export

OURS = {  # a small model of each family
    LLAMA: dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, vocab_size=97, max_seq_len=32,
                norm="rmsnorm", position="rope", ffn="swiglu", bias=False, tie_embeddings=False),
    MISTRAL: dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, vocab_size=97, max_seq_len=32,
                  norm="rmsnorm", position="rope", ffn="swiglu", bias=False, tie_embeddings=False,
                  attention_window=6),
    GPT2: dict(d_model=32, n_layers=2, n_heads=4, d_ff=48, vocab_size=97, max_seq_len=32, norm="layernorm",
               position="learned", ffn="gelu", bias=True, tie_embeddings=True),
    QWEN3: dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, vocab_size=97, max_seq_len=32,
                norm="rmsnorm", position="rope", ffn="swiglu", bias=False, tie_embeddings=False, qk_norm=True),
    DEEPSEEK_V3: dict(d_model=32, n_layers=2, n_heads=4, d_ff=48, vocab_size=97, max_seq_len=32, norm="rmsnorm",
                      position="rope", ffn="swiglu", bias=False, tie_embeddings=False, attention="mla",
                      kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8),
}  # fmt: skip
# Another value of each of our fields that changes the computation (HOW_NOT_WHAT: those that do not)
OUR_ALTERNATIVES = {
    "arch": ["encoder"],
    "d_model": [48],
    "n_layers": [3],
    "n_decoder_layers": [3],
    "n_heads": [2],
    "n_kv_heads": [1],
    "d_ff": [40],
    "vocab_size": [101],
    "max_seq_len": [40],
    "norm": ["layernorm", "rmsnorm"],
    "norm_eps": [1e-2],
    "norm_position": ["post"],
    "position": ["alibi", "sinusoidal"],
    "rope_theta": [500.0],
    "rope_scaling": [
        {"type": "linear", "factor": 2.0},
        {"type": "dynamic", "factor": 2.0, "original_max_seq_len": 12},
        {"type": "yarn", "factor": 4.0, "original_max_seq_len": 8, "beta_fast": 16.0, "beta_slow": 2.0},
        {"type": "llama3", "factor": 4.0, "original_max_seq_len": 8},
    ],
    "attention_window": [5, None],
    "ffn": ["relu", "gelu", "swiglu"],
    "bias": [True, False],
    "tie_embeddings": [True, False],
    "share_embeddings": [False],
    "scale_embeddings": [True],
    "dropout": [0.1],
    "attention_dropout": [0.1],
    "embedding_dropout": [0.2],
    "final_norm": [False],
    "qk_norm": [True, False],
    "attention": ["mla", "standard"],
    "kv_lora_rank": [24],
    "q_lora_rank": [16],
    "qk_rope_head_dim": [6],
    "qk_nope_head_dim": [4],
    "v_head_dim": [12],
}


def test_every_field_of_our_config_is_in_a_table():
    assert set(OUR_ALTERNATIVES) | set(HOW_NOT_WHAT) == set(ModelConfig.model_fields)


def their_model(family, cfg: ModelConfig, state: dict) -> torch.nn.Module:
    hf_config = transformers.AutoConfig.for_model(family.model_type, **family.config(cfg))
    model = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    missing, unexpected = model.load_state_dict(family.to_hf(state, cfg), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    return model


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_of_our_fields_exports_to_the_same_logits_or_is_refused_by_name(family):
    checked = 0
    for name, values in OUR_ALTERNATIVES.items():
        for value in values:
            try:
                cfg = ModelConfig(**{**OURS[family], name: value})
            except ValueError:  # (a combination our config refuses itself)
                continue
            reason = family.incompatibility(cfg)
            if reason is not None:
                assert reason.startswith(f"model.{name}="), (name, value, reason)
                continue
            torch.manual_seed(0)
            ours = randomized(build_model(cfg)).eval()
            theirs = their_model(family, cfg, ours.state_dict())
            with torch.no_grad():
                difference = (ours(IDS) - theirs(IDS).logits).abs().max().item()
            assert difference < 1e-4, (name, value, difference)
            assert (name in family.not_carried) == any(f"model.{name}=" in note for note in family.notes(cfg))
            checked += 1
    assert checked >= 12  # most alternatives are mapped, not refused


def test_export_names_the_dropout_a_class_lacks(tmp_path, capsys):
    cfg = RunConfig.model_validate({"model": {**OURS[LLAMA], "dropout": 0.1}, "data": {"seq_len": 32}})
    write_weights_checkpoint(tmp_path / "ckpt", cfg, build_model(cfg.model).state_dict())
    assert (
        main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    )
    assert "note: model.dropout=0.1 is not carried: LlamaForCausalLM has no such dropout" in capsys.readouterr().err
    assert GPT2.notes(ModelConfig(**{**OURS[GPT2], "dropout": 0.1})) == []  # (GPT-2's resid_pdrop)


def test_safetensors_export_carries_every_field(tmp_path):
    """Our own format: every field that changes the computation at once, and the same logits after export."""
    model = {**OURS[LLAMA], "attention_window": 5, "scale_embeddings": True, "norm_eps": 1e-2, "rope_theta": 500.0}
    model["rope_scaling"] = OUR_ALTERNATIVES["rope_scaling"][2]
    cfg = RunConfig.model_validate({"model": model, "data": {"seq_len": 32}})
    torch.manual_seed(0)
    ours = randomized(build_model(cfg.model)).eval()
    write_weights_checkpoint(tmp_path / "ckpt", cfg, ours.state_dict())
    assert main(["export", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 0
    loaded = load_for_inference(tmp_path / "out")
    assert loaded.cfg.model == cfg.model
    with torch.no_grad():
        assert torch.equal(loaded.model(IDS), ours(IDS))


# ------------------------------------------------------------------------------------------ import

THEIRS = {  # a small transformers config of each family
    LLAMA: dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False),
    MISTRAL: dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=16, tie_word_embeddings=False, sliding_window=6),
    GPT2: dict(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=4, activation_function="gelu"),
    QWEN3: dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=16, tie_word_embeddings=False),
    DEEPSEEK_V3: dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=None, max_position_embeddings=16, tie_word_embeddings=False,
                      kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8,
                      first_k_dense_replace=4, rope_interleave=False),
}  # fmt: skip
_ROPE_ALTERNATIVES = [
    {"rope_type": "default", "rope_theta": 500.0},
    {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "rope_theta": 10000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "mscale": 0.7, "rope_theta": 1e4},
    {"rope_type": "yarn", "factor": 2.0, "beta_fast": 8.0, "rope_theta": 1e4},  # (original: max_position_embeddings)
    {
        "rope_type": "llama3",
        "factor": 4.0,
        "original_max_position_embeddings": 8,
        "low_freq_factor": 1.0,
        "high_freq_factor": 2.0,
        "rope_theta": 10000.0,
    },
    {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
]
_LLAMA_LIKE_ALTERNATIVES = {
    "vocab_size": [101],
    "hidden_size": [48],
    "intermediate_size": [40],
    "num_hidden_layers": [3],
    "num_attention_heads": [2],
    "num_key_value_heads": [1, 4],
    "head_dim": [16],  # (4 heads of 16 in a hidden size of 32: not ours)
    "max_position_embeddings": [64],
    "rms_norm_eps": [1e-2],
    "rope_parameters": _ROPE_ALTERNATIVES,
    "tie_word_embeddings": [True],
    "attention_dropout": [0.1],
    "hidden_act": ["gelu", "swish", "relu"],
    "partial_rotary_factor": [0.5],
    "initializer_range": [0.5],
    "use_cache": [False],
    "pad_token_id": [3],
    "bos_token_id": [4],
    "eos_token_id": [5],
}
THEIR_ALTERNATIVES = {
    LLAMA: {**_LLAMA_LIKE_ALTERNATIVES, "attention_bias": [True], "mlp_bias": [True], "pretraining_tp": [2]},
    MISTRAL: {**_LLAMA_LIKE_ALTERNATIVES, "sliding_window": [3, None]},
    QWEN3: {
        **_LLAMA_LIKE_ALTERNATIVES,
        "num_attention_heads": [],  # (head_dim is explicit: other heads need another hidden size, see PARTLY_OURS)
        "attention_bias": [True],
        "use_sliding_window": [True],
        "sliding_window": [3],
        "max_window_layers": [1],
        "layer_types": [["sliding_attention", "sliding_attention"], ["full_attention", "sliding_attention"]],
    },
    DEEPSEEK_V3: {
        **_LLAMA_LIKE_ALTERNATIVES,
        "num_key_value_heads": [1],
        "attention_bias": [True],
        "pretraining_tp": [2],
        "kv_lora_rank": [24],
        "q_lora_rank": [12],
        "qk_rope_head_dim": [6],
        "qk_nope_head_dim": [4],
        "v_head_dim": [12],
        "first_k_dense_replace": [1, 2],
        "rope_interleave": [True],
        "moe_intermediate_size": [24],
        "n_group": [2],
        "n_routed_experts": [2],
        "n_shared_experts": [2],
        "norm_topk_prob": [False],
        "num_experts_per_tok": [2],
        "output_router_logits": [True],
        "routed_scaling_factor": [2.0],
        "topk_group": [2],
        "num_mtp_layers": [1],
    },
    GPT2: {
        "vocab_size": [101],
        "n_positions": [64],
        "n_embd": [48],
        "n_layer": [3],
        "n_head": [2],
        "n_inner": [40, None],
        "layer_norm_epsilon": [1e-2],
        "resid_pdrop": [0.2],
        "embd_pdrop": [0.3],
        "attn_pdrop": [0.4],
        "activation_function": ["gelu_new", "relu"],
        "scale_attn_weights": [False],
        "scale_attn_by_inverse_layer_idx": [True],
        "reorder_and_upcast_attn": [True],
        "add_cross_attention": [True],
        "tie_word_embeddings": [False],
        "summary_type": ["last"],
        "summary_use_proj": [False],
        "summary_activation": ["tanh"],
        "summary_proj_to_labels": [False],
        "summary_first_dropout": [0.5],
        "initializer_range": [0.5],
        "use_cache": [False],
        "pad_token_id": [3],
        "bos_token_id": [4],
        "eos_token_id": [5],
    },
}


# Mapped keys of which some values are refused: Qwen3's windowed layers (all or none) and its explicit head_dim
# (another hidden size is another head count); DeepSeek-V3's key/value heads (none but the heads) and its MoE layers
PARTLY_OURS = {
    QWEN3: ("layer_types", "hidden_size"),
    DEEPSEEK_V3: ("num_key_value_heads", "first_k_dense_replace"),  # (MLA has no grouping; MoE layers)
}


def own_fields(config_class) -> set[str]:
    base = {f.name for f in dataclasses.fields(transformers.PreTrainedConfig)}
    return {f.name for f in dataclasses.fields(config_class)} - base


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_field_of_transformers_config_class_is_in_a_table(family):
    config_class = transformers.AutoConfig.for_model(family.model_type).__class__
    tables = set(family.mapped) | set(family.neutral) | set(family.ignored) | set(IGNORED_KEYS)
    assert own_fields(config_class) <= tables, own_fields(config_class) - tables
    assert tables <= set(THEIR_ALTERNATIVES[family])  # (each one is tried below)


def save_theirs(family, directory, **fields) -> torch.nn.Module:
    """A random transformers model of ``family`` with ``fields`` changed, saved to ``directory``."""
    hf_config = transformers.AutoConfig.for_model(family.model_type, **{**THEIRS[family], **fields})
    torch.manual_seed(0)
    model = randomized(transformers.AutoModelForCausalLM.from_config(hf_config)).eval()
    model.save_pretrained(directory)
    config = json.loads((directory / "config.json").read_text())  # exactly the field as set (as a checkpoint has)
    (directory / "config.json").write_text(json.dumps({**config, **fields}))
    return model


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_field_of_transformers_imports_to_the_same_logits_or_is_refused_by_name(tmp_path, family):
    refused = set()
    for i, (key, values) in enumerate(THEIR_ALTERNATIVES[family].items()):
        for j, value in enumerate(values):
            directory = tmp_path / f"{i}_{j}"
            theirs = save_theirs(family, directory, **{key: value})
            try:
                cfg, weights = load_hf_dir(directory)
            except ValueError as err:
                pairs = value.items() if isinstance(value, dict) else [(key, value)]  # (rope_parameters: a key of it)
                assert any(f"{k}={v!r}" in str(err) or f"{k}={v}" in str(err) for k, v in pairs), (key, value, err)
                refused.add(key)
                continue
            ours = build_model(cfg).eval()
            ours.load_state_dict(dict(weights))
            with torch.no_grad():
                difference = (ours(IDS) - theirs(IDS).logits).abs().max().item()
            assert difference < 1e-4, (key, value, difference)
    assert set(family.neutral) <= refused
    # (values of mapped keys that are not ours)
    assert refused - set(family.neutral) <= {"head_dim", "rope_parameters", *PARTLY_OURS.get(family, ())}


def test_the_refused_llama_fields_and_values_are_named(tmp_path):
    for key, value, message in [
        ("attention_bias", True, "Llama attention_bias=True is not supported (only False)"),
        ("mlp_bias", True, "Llama mlp_bias=True is not supported (only False)"),
        ("hidden_act", "gelu", "Llama hidden_act='gelu' is not supported (only 'silu' or 'swish')"),
    ]:
        save_theirs(LLAMA, tmp_path / key, **{key: value})
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_hf_dir(tmp_path / key)


def test_import_of_a_llama_with_attention_biases_exits_2_with_one_line(tmp_path, capsys):
    save_theirs(LLAMA, tmp_path / "hf", attention_bias=True)
    capsys.readouterr()  # (transformers' own progress bar)
    assert main(["import", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"megatransformer import: error: {tmp_path / 'hf'}: Llama attention_bias=True is not supported (only False)\n"
    )
    assert not (tmp_path / "ckpt").exists()


def test_weights_that_the_config_does_not_describe_are_refused(tmp_path):
    """A config.json that hides the biases its weights hold ("llamafied" checkpoints) is not silently dropped."""
    save_theirs(LLAMA, tmp_path / "hf", attention_bias=True)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "attention_bias": False}))
    with pytest.raises(ValueError, match=r"holds 8 tensors its config does not describe, e\.g\. model\.layers\.0\."):
        load_hf_dir(tmp_path / "hf")


def test_weights_of_other_shapes_than_the_config_describes_are_refused(tmp_path):
    save_theirs(LLAMA, tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    with pytest.raises(ValueError, match=r"weight decoder.layers.0.ffn.gate_proj.weight is \[48, 32\], its config"):
        load_hf_dir(tmp_path / "hf")


def test_dynamic_ntk_imports_with_its_trained_length_and_factor_times_that_allowed(tmp_path):
    save_theirs(LLAMA, tmp_path / "hf", rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4})
    cfg, _ = load_hf_dir(tmp_path / "hf")
    assert (cfg.rope_scaling.original_max_seq_len, cfg.max_seq_len) == (16, 64)
    save_hf_dir(tmp_path / "back", cfg, build_model(cfg).state_dict())
    assert json.loads((tmp_path / "back" / "config.json").read_text())["max_position_embeddings"] == 16
