"""Numerical parity with independent implementations: Hugging Face LlamaForCausalLM and GPT2LMHeadModel."""

from __future__ import annotations

import pytest
import torch
from support.models import assert_exported_logits_match, gpt2_style, llama_style

from megatransformer.hf import GPT2, LLAMA, hf_incompatibility, load_hf_dir, save_hf_dir
from megatransformer.hf.llama import from_llama_state_dict, llama_config, to_llama_state_dict
from megatransformer.model import build_model

transformers = pytest.importorskip("transformers")  # a test dependency: `pip install -e .[test]`


@pytest.mark.parametrize("tie", [False, True])
def test_llama_logits_match_transformers(tie):
    cfg = llama_style(tie_embeddings=tie)
    torch.manual_seed(0)
    ours = build_model(cfg).eval()
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(cfg))).eval()
    missing, unexpected = theirs.load_state_dict(to_llama_state_dict(ours.state_dict(), cfg), strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set())
    ids = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = theirs(ids).logits
        got = ours(ids)
    assert (got - expected).abs().max().item() < 1e-5


def test_llama_weights_round_trip():
    cfg = llama_style()
    ours = build_model(cfg)
    back = from_llama_state_dict(to_llama_state_dict(ours.state_dict(), cfg), cfg)
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back[name], tensor), name


@pytest.mark.parametrize(
    "option,value",
    [("norm", "layernorm"), ("position", "learned"), ("ffn", "gelu"), ("norm_position", "post"), ("arch", "encoder")],
)
def test_non_llama_configs_are_refused_by_name(option, value):
    reason = LLAMA.incompatibility(llama_style(**{option: value}))
    assert reason is not None and option in reason


# ------------------------------------------------------------------------------------------------ GPT-2


@pytest.mark.parametrize("family,cfg", [(LLAMA, llama_style(tie_embeddings=False)), (GPT2, gpt2_style())])
def test_exported_directory_loads_in_transformers_with_the_same_logits(tmp_path, family, cfg):
    assert_exported_logits_match(tmp_path / "hf", cfg, family)


@pytest.mark.parametrize(
    "option,value",
    [
        ("norm", "rmsnorm"),
        ("position", "rope"),
        ("ffn", "relu"),
        ("bias", False),
        ("tie_embeddings", False),
        ("n_kv_heads", 2),
    ],
)
def test_non_gpt2_configs_are_refused_by_name(option, value):
    reason = hf_incompatibility(gpt2_style(**{option: value}))
    assert reason is not None and f"model.{option}=" in reason and "GPT-2 needs" in reason


def test_gpt2_with_the_tanh_gelu_is_not_imported(tmp_path):
    cfg = gpt2_style()
    save_hf_dir(tmp_path / "hf", cfg, build_model(cfg).state_dict())
    config = tmp_path / "hf" / "config.json"
    config.write_text(config.read_text().replace('"activation_function": "gelu"', '"activation_function": "gelu_new"'))
    with pytest.raises(ValueError, match="activation_function='gelu_new' is not supported"):
        load_hf_dir(tmp_path / "hf")
