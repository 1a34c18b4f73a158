"""QK-norm (``model.qk_norm``): RMSNorm over each head's queries and keys in self- and cross-attention, equal to
transformers' Qwen3ForCausalLM both ways (logits, greedy generation with and without a KV cache), refused by
the families that lack it."""

from __future__ import annotations

import json
import os

import pytest
import torch
from support import assert_one_line
from support.models import assert_exported_logits_match, llama_style, randomized, run_config, tiny_config

from megatransformer.cli import main
from megatransformer.hf import GPT2, LLAMA, MISTRAL, QWEN3, hf_family, load_hf_dir, save_hf_dir
from megatransformer.model import build_model, generate
from megatransformer.model.masks import PAD_SEGMENT
from megatransformer.model.tp_plan import has_partial_gradient, partition_dim
from megatransformer.planner import Layout, activation_parts

transformers = pytest.importorskip("transformers")  # a test dependency: `pip install -e .[test]`


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_every_attention_gets_a_query_and_a_key_norm_of_head_dim(arch):
    cfg = tiny_config(arch=arch, qk_norm=True)
    params = dict(build_model(cfg).named_parameters())
    attentions = {name.removesuffix(".q_proj.weight") for name in params if name.endswith(".q_proj.weight")}
    assert len(attentions) == {"decoder": 2, "encoder": 2, "encoder_decoder": 6}[arch]  # (cross-attention too)
    for attn in attentions:
        for norm in ("q_norm", "k_norm"):
            assert params[f"{attn}.{norm}.weight"].shape == (cfg.head_dim,)
            # replicated under tensor parallelism, each rank's gradient a part of the whole (summed in training)
            assert partition_dim(f"{attn}.{norm}.weight") is None and has_partial_gradient(f"{attn}.{norm}.weight")
    assert [name for name in params if has_partial_gradient(name) and "_norm." not in name] == []
    assert not has_partial_gradient("decoder.layers.0.attn_norm.weight")
    plain = dict(build_model(tiny_config(arch=arch)).named_parameters())
    assert set(params) - set(plain) == {f"{a}.{n}.weight" for a in attentions for n in ("q_norm", "k_norm")}


def test_the_norms_act_on_each_head_before_the_scores():
    """Scaling a head's query weights changes nothing (the norm removes it); scaling the norm's weight does."""
    torch.manual_seed(0)
    model = build_model(tiny_config(qk_norm=True, norm_eps=1e-12)).eval()  # (an eps that changes nothing)
    ids = torch.randint(0, 97, (2, 12))
    attn = model.decoder.layers[0].self_attn
    with torch.no_grad():
        before = model(ids)
        attn.q_proj.weight[: attn.head_dim] *= 3.0  # the first head's queries
        attn.k_proj.weight[attn.head_dim :] *= 0.5  # the second kv head's keys
        assert torch.allclose(model(ids), before, atol=1e-5)
        attn.q_norm.weight.mul_(2.0)
        assert not torch.allclose(model(ids), before, atol=1e-3)


@pytest.mark.parametrize("arch", ["decoder", "encoder", "encoder_decoder"])
def test_backends_agree_with_qk_norm_on_packed_documents(arch):
    torch.manual_seed(0)
    eager = build_model(tiny_config(arch=arch, qk_norm=True, attention_backend="eager")).eval()
    segments = torch.tensor([[1, 1, 1, 2, 2, 2, 2, PAD_SEGMENT], [1, 1, 1, 1, 1, 2, 2, 2]])
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 2]])
    batch = {"input_ids": torch.randint(0, 97, (2, 8)), "segment_ids": segments, "position_ids": positions}
    if arch == "encoder_decoder":
        batch |= {"decoder_input_ids": batch["input_ids"].flip(1), "decoder_segment_ids": segments}
        batch["decoder_position_ids"] = positions
    keep = (segments != PAD_SEGMENT).unsqueeze(-1)
    with torch.no_grad():
        want = eager(**batch) * keep
        for backend in ("sdpa", "chunked"):
            model = build_model(tiny_config(arch=arch, qk_norm=True, attention_backend=backend)).eval()
            model.load_state_dict(eager.state_dict())
            assert torch.allclose(model(**batch) * keep, want, atol=1e-5), backend


@pytest.mark.parametrize(
    "arch,position", [("decoder", "rope"), ("decoder", "alibi"), ("encoder_decoder", "sinusoidal")]
)
def test_generation_with_a_kv_cache_equals_generation_without(arch, position):
    """Cached keys are normed once, cross-attention's memory keys (projected once) too; with ALiBi as well."""
    torch.manual_seed(0)
    model = randomized(build_model(tiny_config(arch=arch, position=position, qk_norm=True, init_std=0.2))).eval()
    prompt = torch.randint(3, 97, (2, 6))
    start = {"decoder_start_id": 0} if arch == "encoder_decoder" else {}
    cached = generate(model, prompt, 24, use_cache=True, **start)
    assert torch.equal(cached, generate(model, prompt, 24, use_cache=False, **start))


# ----------------------------------------------------------------------------------- transformers: Qwen3


def qwen3_style(**overrides):
    return llama_style(qk_norm=True, **overrides)


@pytest.mark.parametrize("tie,window", [(False, None), (True, None), (False, 7)])
def test_qk_norm_exports_to_qwen3_with_the_same_logits_and_imports_back(tmp_path, tie, window):
    assert_exported_logits_match(tmp_path / "hf", qwen3_style(tie_embeddings=tie, attention_window=window), QWEN3)


@pytest.mark.parametrize("window", [None, 12])
def test_greedy_generation_of_64_tokens_equals_qwen3s_with_and_without_a_cache(tmp_path, window):
    """With a sliding window too: 72 positions, six windows."""
    cfg = qwen3_style(n_layers=2, vocab_size=256, max_seq_len=96, init_std=0.2, attention_window=window)
    torch.manual_seed(0)
    ours = randomized(build_model(cfg)).eval()
    save_hf_dir(tmp_path / "hf", cfg, ours.state_dict())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "Qwen3ForCausalLM"
    prompt = torch.randint(0, cfg.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    ids = {}
    for use_cache in (True, False):
        expected = theirs.generate(
            prompt, max_new_tokens=64, do_sample=False, eos_token_id=None, pad_token_id=0, use_cache=use_cache
        )[:, 8:]
        ids[use_cache] = generate(ours, prompt, 64, temperature=0.0, use_cache=use_cache)
        assert torch.equal(ids[use_cache], expected), use_cache
    assert len(set(ids[True].flatten().tolist())) > 4  # (not one token repeated)
    with torch.no_grad():  # the whole sequence's logits, prompt and generation
        full = torch.cat([prompt, ids[True]], 1)
        assert (ours(full) - theirs(full).logits).abs().max().item() < 1e-4


def test_a_qwen3_directory_written_by_transformers_imports_with_its_norms(tmp_path):
    config = transformers.Qwen3Config(**{**_qwen3_kwargs(), "tie_word_embeddings": False})
    torch.manual_seed(0)
    theirs = randomized(transformers.Qwen3ForCausalLM(config)).eval()
    theirs.save_pretrained(tmp_path / "hf")
    cfg, state = load_hf_dir(tmp_path / "hf")
    assert cfg.qk_norm and hf_family(cfg) is QWEN3
    ours = build_model(cfg).eval()
    ours.load_state_dict(dict(state))
    assert torch.equal(ours.decoder.layers[1].self_attn.k_norm.weight, theirs.model.layers[1].self_attn.k_norm.weight)
    ids = torch.randint(0, cfg.vocab_size, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-4


def _qwen3_kwargs() -> dict:
    return dict(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        rms_norm_eps=1e-6,
    )


@pytest.mark.parametrize(
    "change,message",
    [
        ({"attention_bias": True}, "Qwen3 attention_bias=True is not supported"),
        (
            {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1, "layer_types": None},
            r"Qwen3 layer_types=\['full_attention', 'sliding_attention'.* in every layer or in none",
        ),
        (
            {"use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention", "full_attention"]},
            "a sliding window in every layer or in none",
        ),
        ({"head_dim": 32}, "head_dim=32 is not supported: heads=4 x head_dim must be hidden_size=64"),
    ],
)
def test_qwen3_configs_we_cannot_express_are_refused_by_name(tmp_path, change, message):
    save_hf_dir(tmp_path / "hf", qwen3_style(), build_model(qwen3_style()).state_dict())
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(ValueError, match=message):
        load_hf_dir(tmp_path / "hf")


def test_olmo2_is_refused_on_import_with_the_reason(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"]}))
    assert main(["import", "--hf", str(tmp_path), "--out", str(tmp_path / "ckpt")]) == 2
    assert_one_line(
        capsys.readouterr().err,
        "model_type='olmo2': OLMo 2 normalises each sub-layer's output inside the residual",
        "its QK-norm spans all heads at once",
    )
    assert not (tmp_path / "ckpt").exists()


def test_families_without_qk_norm_refuse_it_and_qwen3_requires_it():
    cfg = qwen3_style()
    assert LLAMA.incompatibility(cfg) == "model.qk_norm=True (Llama needs False)"
    assert MISTRAL.incompatibility(cfg.model_copy(update={"attention_window": 8})) == (
        "model.qk_norm=True (Mistral needs False)"
    )
    gpt2 = GPT2.incompatibility(cfg.model_copy(update=dict(norm="layernorm", position="learned")))
    assert gpt2 is not None and "GPT-2 needs" in gpt2
    assert QWEN3.incompatibility(llama_style()) == "model.qk_norm=False (Qwen3 needs True)"
    assert QWEN3.incompatibility(cfg.model_copy(update={"attention_window": 8})) is None
    assert hf_family(llama_style()) is LLAMA and hf_family(cfg) is QWEN3


def test_the_activation_estimate_counts_what_qk_norm_keeps_for_the_backward_pass():
    """The queries and keys before their norms: the estimate's difference is the activations autograd saves
    more (tensors of the graph; like the other norms' statistics, the per-row 1/rms is left out)."""

    def saved_bytes(cfg) -> int:
        storages = {}

        def pack(tensor):
            if tensor.requires_grad and not isinstance(tensor, torch.nn.Parameter):
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        ids = torch.randint(0, 128, (2, 32))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            build_model(cfg.model).train()(ids, labels=ids)
        return sum(storages.values())

    plain = run_config()
    normed = run_config(model=plain.model.model_dump() | {"qk_norm": True})

    def estimate(cfg) -> int:
        return activation_parts(cfg, Layout(1, 1, 1, 0, False, 1, False, 2, 1), "cpu")["activations"]

    more = estimate(normed) - estimate(plain)
    assert more == saved_bytes(normed) - saved_bytes(plain) == 2 * 32 * (32 + 16) * 4


def test_info_counts_the_norm_weights_and_no_flops_for_them(capsys):
    """``megatransformer info``: 2 x head_dim parameters more per attention module (an encoder-decoder's
    decoder layer has two), FLOPs per token unchanged (elementwise work, not counted, as for every norm)."""

    def info(*overrides: str) -> dict:
        model = ["objective=span_corruption", "model.arch=encoder_decoder", "model.d_model=64", "model.n_heads=4"]
        model += ["model.n_layers=2", "model.n_decoder_layers=3"]
        assert main(["info", "--config", os.devnull, "--json", *model, *overrides]) == 0
        return json.loads(capsys.readouterr().out)

    plain, normed = info(), info("model.qk_norm=true")
    assert normed["config"]["model"]["qk_norm"] and not plain["config"]["model"]["qk_norm"]
    assert normed["params"] - plain["params"] == (2 + 3 * 2) * 2 * 16  # 2 encoder, 3 x 2 decoder attentions
    assert normed["flops_per_token"] == plain["flops_per_token"]
