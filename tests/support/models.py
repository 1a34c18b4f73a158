"""Tiny in-process models."""

from __future__ import annotations

import torch

from megatransformer.config import ModelConfig
from megatransformer.model import build_model

# A decoder that builds and runs in milliseconds; the tensor-parallel degree 2 divides its heads and d_ff.
TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 48, "vocab_size": 97, "max_seq_len": 64}


def tiny_config(**fields) -> ModelConfig:
    """The tiny model's config with ``fields`` changed."""
    return ModelConfig(**(TINY | fields))


def llama_model(seed: int = 0):
    """A random Llama-style model (large init: peaked next-token distributions) and transformers' Llama with the
    same weights: (config, ours, theirs)."""
    import transformers

    from megatransformer.hf import llama_config, to_llama_state_dict

    cfg = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=96, vocab_size=512, max_seq_len=64,
                      norm="rmsnorm", position="rope", ffn="swiglu", rope_theta=10000.0, norm_eps=1e-6,
                      init_std=0.2)
    torch.manual_seed(seed)
    ours = build_model(cfg).eval()
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(cfg))).eval()
    theirs.load_state_dict(to_llama_state_dict(ours.state_dict(), cfg), strict=False)
    theirs.tie_weights()
    return cfg, ours, theirs
