"""``GPT2LMHeadModel``: pre-LN, layernorm, learned positions, (exact) gelu, biases, MHA, tied embeddings."""

from __future__ import annotations

import torch

from megatransformer.config import ModelConfig
from megatransformer.hf.family import Family, Neutral, build_config, check_leftovers, check_tied_head, expand_names

_GPT2_LAYER_NAMES = [  # (ours, GPT-2) pairs copied as they are; the attention and MLP matrices are below
    ("decoder.layers.{i}.attn_norm.weight", "transformer.h.{i}.ln_1.weight"),
    ("decoder.layers.{i}.attn_norm.bias", "transformer.h.{i}.ln_1.bias"),
    ("decoder.layers.{i}.ffn_norm.weight", "transformer.h.{i}.ln_2.weight"),
    ("decoder.layers.{i}.ffn_norm.bias", "transformer.h.{i}.ln_2.bias"),
]
_GPT2_GLOBAL_NAMES = [
    ("embed_tokens.weight", "transformer.wte.weight"),
    ("decoder.positions.weight", "transformer.wpe.weight"),
    ("decoder.norm.weight", "transformer.ln_f.weight"),
    ("decoder.norm.bias", "transformer.ln_f.bias"),
]
# GPT-2's Conv1D stores weights as [in, out]: ours transposed
_GPT2_LINEARS = [
    ("decoder.layers.{i}.self_attn.o_proj", "transformer.h.{i}.attn.c_proj"),
    ("decoder.layers.{i}.ffn.up_proj", "transformer.h.{i}.mlp.c_fc"),
    ("decoder.layers.{i}.ffn.down_proj", "transformer.h.{i}.mlp.c_proj"),
]


_GPT2_REQUIRES = {
    "arch": "decoder",
    "norm_position": "pre",
    "norm": "layernorm",
    "position": "learned",
    "ffn": "gelu",
    "bias": True,
    "scale_embeddings": False,
    "final_norm": True,
    "tie_embeddings": True,
    "n_kv_heads": lambda cfg: cfg.n_heads if cfg.n_kv_heads is not None else None,
    "attention_window": None,
    "qk_norm": False,
    "attention": "standard",
}
_GPT2_KEYS = (
    "vocab_size",
    "n_positions",
    "n_embd",
    "n_layer",
    "n_head",
    "n_inner",
    "layer_norm_epsilon",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
)
_GPT2_NEUTRAL = {
    "activation_function": Neutral("gelu_new", ("gelu",)),  # (gelu_new is the tanh approximation)
    "scale_attn_weights": Neutral(True, (True,)),
    "scale_attn_by_inverse_layer_idx": Neutral(False, (False,)),
    "reorder_and_upcast_attn": Neutral(False, (False,)),
    "add_cross_attention": Neutral(False, (False,)),
    "tie_word_embeddings": Neutral(True, (True,)),
}
_GPT2_HEADS_OF_OTHER_CLASSES = (  # GPT2DoubleHeadsModel's multiple-choice head: not part of GPT2LMHeadModel
    "summary_type",
    "summary_use_proj",
    "summary_activation",
    "summary_proj_to_labels",
    "summary_first_dropout",
)


def gpt2_config(cfg: ModelConfig) -> dict:
    """``GPT2Config`` keyword arguments equivalent to ``cfg``."""
    reason = GPT2.incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as GPT2LMHeadModel: {reason}")
    return dict(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=cfg.d_ff,
        activation_function="gelu",
        layer_norm_epsilon=cfg.norm_eps,
        resid_pdrop=cfg.dropout,
        attn_pdrop=cfg.attention_dropout,
        embd_pdrop=cfg.dropout if cfg.embedding_dropout is None else cfg.embedding_dropout,
        tie_word_embeddings=True,
    )


def model_config_from_gpt2(hf: dict) -> ModelConfig:
    """Our ModelConfig for a GPT-2 ``config.json`` dict (dropouts: transformers' defaults when absent)."""
    dropout, embedding_dropout = hf.get("resid_pdrop", 0.1), hf.get("embd_pdrop", 0.1)
    return build_config(
        arch="decoder",
        d_model=hf["n_embd"],
        n_layers=hf["n_layer"],
        n_heads=hf["n_head"],
        d_ff=hf.get("n_inner") or 4 * hf["n_embd"],
        vocab_size=hf["vocab_size"],
        max_seq_len=hf["n_positions"],
        norm="layernorm",
        norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        position="learned",
        ffn="gelu",
        bias=True,
        tie_embeddings=True,
        dropout=dropout,
        attention_dropout=hf.get("attn_pdrop", 0.1),
        embedding_dropout=None if embedding_dropout == dropout else embedding_dropout,
    )


def to_gpt2_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {theirs: state[ours] for ours, theirs in expand_names(_GPT2_GLOBAL_NAMES, _GPT2_LAYER_NAMES, cfg.n_layers)}
    for i in range(cfg.n_layers):
        attn = f"decoder.layers.{i}.self_attn."
        qkv = [f"{attn}{p}_proj" for p in "qkv"]
        out[f"transformer.h.{i}.attn.c_attn.weight"] = torch.cat([state[f"{n}.weight"] for n in qkv]).t()
        out[f"transformer.h.{i}.attn.c_attn.bias"] = torch.cat([state[f"{n}.bias"] for n in qkv])
        for ours, theirs in _GPT2_LINEARS:
            ours, theirs = ours.format(i=i), theirs.format(i=i)
            out[f"{theirs}.weight"], out[f"{theirs}.bias"] = state[f"{ours}.weight"].t(), state[f"{ours}.bias"]
    return out


def from_gpt2_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = {k if k.startswith(("transformer.", "lm_head.")) else f"transformer.{k}": v for k, v in state.items()}
    pairs = expand_names(_GPT2_GLOBAL_NAMES, _GPT2_LAYER_NAMES, cfg.n_layers)
    needed = [theirs for _, theirs in pairs] + [f"transformer.h.{i}.attn.c_attn.weight" for i in range(cfg.n_layers)]
    missing = [name for name in needed if name not in state]
    if missing:
        raise ValueError(f"GPT-2 checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    check_tied_head(state, "lm_head.weight", "transformer.wte.weight", "GPT-2")
    out = {ours: state[theirs] for ours, theirs in pairs}
    out["lm_head.weight"] = state["transformer.wte.weight"]
    for i in range(cfg.n_layers):
        attn = f"decoder.layers.{i}.self_attn."
        weights = state[f"transformer.h.{i}.attn.c_attn.weight"].t().chunk(3)
        biases = state[f"transformer.h.{i}.attn.c_attn.bias"].chunk(3)
        for p, w, b in zip("qkv", weights, biases):
            out[f"{attn}{p}_proj.weight"], out[f"{attn}{p}_proj.bias"] = w, b
        for ours, theirs in _GPT2_LINEARS:
            ours, theirs = ours.format(i=i), theirs.format(i=i)
            out[f"{ours}.weight"], out[f"{ours}.bias"] = state[f"{theirs}.weight"].t(), state[f"{theirs}.bias"]
    used = {theirs for _, theirs in pairs} | {"lm_head.weight"}  # (tied: transformers reads the embedding)
    for i in range(cfg.n_layers):
        linears = [f"transformer.h.{i}.attn.c_attn"] + [theirs.format(i=i) for _, theirs in _GPT2_LINEARS]
        used |= {f"{name}.{kind}" for name in linears for kind in ("weight", "bias")}
    check_leftovers(state, used, "GPT-2")
    return out


GPT2 = Family(
    "GPT-2",
    "gpt2",
    "GPT2LMHeadModel",
    requires=_GPT2_REQUIRES,
    config=gpt2_config,
    to_hf=to_gpt2_state_dict,
    from_hf=from_gpt2_state_dict,
    model_config=model_config_from_gpt2,
    mapped=_GPT2_KEYS,
    neutral=_GPT2_NEUTRAL,
    ignored=_GPT2_HEADS_OF_OTHER_CLASSES,
)
