"""Numerical parity with an independent implementation: Hugging Face LlamaForCausalLM."""

from __future__ import annotations

import pytest
import torch

from megatransformer.config import ModelConfig
from megatransformer.hf import from_llama_state_dict, llama_config, llama_incompatibility, to_llama_state_dict
from megatransformer.model import build_model

transformers = pytest.importorskip("transformers")  # a test dependency: `pip install -e .[test]`


def llama_style(**overrides) -> ModelConfig:
    base = dict(d_model=64, n_layers=3, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=211, max_seq_len=64,
                norm="rmsnorm", position="rope", ffn="swiglu", rope_theta=500000.0, norm_eps=1e-6)
    return ModelConfig(**{**base, **overrides})


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


@pytest.mark.parametrize("option,value", [("norm", "layernorm"), ("position", "learned"), ("ffn", "gelu"),
                                          ("norm_position", "post"), ("arch", "encoder")])
def test_non_llama_configs_are_refused_by_name(option, value):
    reason = llama_incompatibility(llama_style(**{option: value}))
    assert reason is not None and option in reason
