"""Multi-head latent attention against transformers' DeepseekV3ForCausalLM, both directions: our export loads with
the same logits and the same greedy 64 tokens (with and without either side's cache); a DeepSeek-V3 directory made
by transformers (interleaved RoPE, its default) imports to the same function; what we do not build is refused."""

from __future__ import annotations

import json

import pytest
import torch
from support.models import assert_exported_logits_match, llama_style, randomized

from megatransformer.hf import DEEPSEEK_V3, LLAMA, hf_family, load_hf_dir, save_hf_dir
from megatransformer.model import build_model
from megatransformer.model.generate import generate

transformers = pytest.importorskip("transformers")

MLA = dict(n_kv_heads=None, attention="mla", kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12)


def mla_style(**overrides):
    return llama_style(**{**MLA, **overrides})


def assert_same_greedy_tokens(ours, theirs, vocab_size: int, new: int = 64) -> None:
    prompt = torch.randint(0, vocab_size, (1, 8), generator=torch.Generator().manual_seed(2))
    options = dict(max_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = theirs.generate(prompt, **options)[:, 8:]
    assert torch.equal(theirs.generate(prompt, use_cache=False, **options)[:, 8:], expected)
    assert torch.equal(generate(ours, prompt, new), expected)
    assert torch.equal(generate(ours, prompt, new, use_cache=False), expected)
    assert len(set(expected[0].tolist())) > 8  # (a varied continuation, not one token repeated)


YARN = {"type": "yarn", "factor": 4.0, "original_max_seq_len": 16}


@pytest.mark.parametrize(
    "fields",
    [{}, {"q_lora_rank": 24, "tie_embeddings": True}, {"rope_scaling": YARN}],
    ids=["q_proj", "q_lora", "yarn"],
)
def test_export_loads_as_deepseek_v3_with_the_same_logits_and_imports_back(tmp_path, fields):
    cfg = mla_style(**fields)
    assert hf_family(cfg) is DEEPSEEK_V3
    assert_exported_logits_match(tmp_path / "hf", cfg, DEEPSEEK_V3)
    written = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert written["first_k_dense_replace"] == cfg.n_layers and written["rope_interleave"] is False


def test_export_generates_the_same_64_greedy_tokens(tmp_path):
    cfg = mla_style(q_lora_rank=24, init_std=0.2, tie_embeddings=False)
    torch.manual_seed(0)
    ours = randomized(build_model(cfg)).eval()
    save_hf_dir(tmp_path / "hf", cfg, ours.state_dict())
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert_same_greedy_tokens(ours, theirs, cfg.vocab_size)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_a_transformers_deepseek_v3_imports_to_the_same_function(tmp_path, q_lora_rank):
    """transformers' own model, with its default interleaved RoPE pairs, saved and imported."""
    config = transformers.DeepseekV3Config(
        vocab_size=211,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=q_lora_rank,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=12,
        first_k_dense_replace=2,
        max_position_embeddings=128,
        initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    assert config.rope_interleave
    torch.manual_seed(0)
    theirs = randomized(transformers.DeepseekV3ForCausalLM(config)).eval()
    theirs.save_pretrained(tmp_path / "hf")
    cfg, weights = load_hf_dir(tmp_path / "hf")
    assert (cfg.attention, cfg.kv_lora_rank, cfg.q_lora_rank, cfg.v_head_dim) == ("mla", 32, q_lora_rank, 12)
    ours = build_model(cfg).eval()
    ours.load_state_dict(dict(weights))
    ids = torch.randint(0, 211, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-4
    assert_same_greedy_tokens(ours, theirs, 211)


def write_config(tmp_path, **changes):
    cfg = mla_style()
    save_hf_dir(tmp_path / "hf", cfg, build_model(cfg).state_dict())
    path = tmp_path / "hf" / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return tmp_path / "hf"


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"first_k_dense_replace": 1}, "layers 1-2 are mixture-of-experts layers, which megatransformer does not"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "mscale_all_dim": 1.0}},
            "rope_type=yarn with mscale_all_dim=1.0 is not supported",
        ),
        ({"attention_bias": True}, "DeepSeek-V3 attention_bias=True is not supported"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2 != num_attention_heads=4"),
    ],
)
def test_deepseek_features_we_do_not_build_are_refused_by_name(tmp_path, changes, message):
    with pytest.raises(ValueError) as err:
        load_hf_dir(write_config(tmp_path, **changes))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_mla_maps_only_onto_deepseek_and_a_window_onto_nothing():
    assert "model.attention=mla (Llama needs standard)" in LLAMA.incompatibility(mla_style())
    assert "model.attention=standard (DeepSeek-V3 needs mla)" in DEEPSEEK_V3.incompatibility(llama_style())
    assert hf_family(llama_style()) is LLAMA
    reason = DEEPSEEK_V3.incompatibility(mla_style(attention_window=16))
    assert reason == "model.attention_window=16 (DeepSeek-V3 needs None)"
