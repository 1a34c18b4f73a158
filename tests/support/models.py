"""Tiny in-process models."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from megatransformer.config import ModelConfig, RunConfig
from megatransformer.model import build_model

# A decoder that builds and runs in milliseconds; the tensor-parallel degree 2 divides its heads and d_ff.
TINY = {"d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 48, "vocab_size": 97, "max_seq_len": 64}


def tiny_config(**fields) -> ModelConfig:
    """The tiny model's config with ``fields`` changed."""
    return ModelConfig(**(TINY | fields))


def run_config(**sections) -> RunConfig:
    """A run config of a one-layer model at 32 tokens, with ``sections`` (``model=``: another model)."""
    model = dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=64, vocab_size=128, max_seq_len=32)
    return RunConfig.model_validate({"model": model, "data": {"seq_len": 32}, **sections})


def llama_model(seed: int = 0):
    """A random Llama-style model (large init: peaked next-token distributions) and transformers' Llama with the
    same weights: (config, ours, theirs)."""
    import transformers

    from megatransformer.hf.llama import llama_config, to_llama_state_dict

    cfg = llama_style(n_layers=2, vocab_size=512, rope_theta=10000.0, init_std=0.2)
    torch.manual_seed(seed)
    ours = build_model(cfg).eval()
    theirs = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(cfg))).eval()
    theirs.load_state_dict(to_llama_state_dict(ours.state_dict(), cfg), strict=False)
    theirs.tie_weights()
    return cfg, ours, theirs


def randomized(model: torch.nn.Module) -> torch.nn.Module:
    """Non-trivial norm weights and biases (init sets them to 1 and 0, which would hide a swapped mapping)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.copy_(torch.randn_like(param) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
    return model


def assert_exported_logits_match(directory, cfg: ModelConfig, family, length: int = 40, **options) -> None:
    """A randomized model of ``cfg`` exported to ``directory`` (``save_hf_dir``'s ``options``) loads in transformers
    as ``family`` with the same logits, and imports back to the same config and weights."""
    import transformers

    from megatransformer.hf import load_hf_dir, save_hf_dir

    torch.manual_seed(0)
    ours = randomized(build_model(cfg)).eval()
    assert save_hf_dir(directory, cfg, ours.state_dict(), **options) is family
    theirs = transformers.AutoModelForCausalLM.from_pretrained(directory).eval()
    assert type(theirs).__name__ == family.architecture
    ids = torch.randint(0, cfg.vocab_size, (2, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max().item() < 1e-5
    back_cfg, back = load_hf_dir(directory)
    back = dict(back)
    assert back_cfg.model_dump() == cfg.model_dump()
    for name, tensor in ours.state_dict().items():
        assert torch.equal(back[name], tensor), name


def llama_style(**overrides) -> ModelConfig:
    """A small Llama-family config (RMSNorm, RoPE, GQA, SwiGLU), with ``overrides``."""
    base = dict(
        d_model=64,
        n_layers=3,
        n_heads=4,
        n_kv_heads=2,
        d_ff=96,
        vocab_size=211,
        max_seq_len=64,
        norm="rmsnorm",
        position="rope",
        ffn="swiglu",
        rope_theta=500000.0,
        norm_eps=1e-6,
    )
    return ModelConfig(**{**base, **overrides})


def gpt2_style(**overrides) -> ModelConfig:
    """A small GPT-2-family config (LayerNorm, learned positions, GELU, biases, tied), with ``overrides``."""
    base = dict(
        d_model=64,
        n_layers=3,
        n_heads=4,
        d_ff=160,
        vocab_size=211,
        max_seq_len=64,
        norm="layernorm",
        position="learned",
        ffn="gelu",
        bias=True,
        tie_embeddings=True,
        norm_eps=1e-5,
    )
    return ModelConfig(**{**base, **overrides})


class ReadOnLookup(Mapping[str, torch.Tensor]):
    """``state``, each tensor a new copy when looked up (as ``checkpoint.LazyWeights`` reads one from its file)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self.state = state

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.state[name].clone()

    def __iter__(self) -> Iterator[str]:
        return iter(self.state)

    def __len__(self) -> int:
        return len(self.state)
