"""``LlamaForCausalLM``: the Llama-like tables (weight names, fixed fields, config keys) the other Llama-like
families build on."""

from __future__ import annotations

import math
import re

import torch

from megatransformer.config import ModelConfig
from megatransformer.hf.family import (
    SILU,
    Family,
    Neutral,
    build_config,
    check_leftovers,
    check_tied_head,
    expand_names,
)
from megatransformer.hf.rope import max_position_embeddings, rope_parameters, rope_scaling_from

# (our name, Llama name) templates; {i} is the layer index
LAYER_NAMES = [
    ("decoder.layers.{i}.attn_norm.weight", "model.layers.{i}.input_layernorm.weight"),
    ("decoder.layers.{i}.self_attn.q_proj.weight", "model.layers.{i}.self_attn.q_proj.weight"),
    ("decoder.layers.{i}.self_attn.k_proj.weight", "model.layers.{i}.self_attn.k_proj.weight"),
    ("decoder.layers.{i}.self_attn.v_proj.weight", "model.layers.{i}.self_attn.v_proj.weight"),
    ("decoder.layers.{i}.self_attn.o_proj.weight", "model.layers.{i}.self_attn.o_proj.weight"),
    ("decoder.layers.{i}.ffn_norm.weight", "model.layers.{i}.post_attention_layernorm.weight"),
    ("decoder.layers.{i}.ffn.gate_proj.weight", "model.layers.{i}.mlp.gate_proj.weight"),
    ("decoder.layers.{i}.ffn.up_proj.weight", "model.layers.{i}.mlp.up_proj.weight"),
    ("decoder.layers.{i}.ffn.down_proj.weight", "model.layers.{i}.mlp.down_proj.weight"),
]
_QK_NORM_NAMES = [
    ("decoder.layers.{i}.self_attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("decoder.layers.{i}.self_attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
]
GLOBAL_NAMES = [
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("decoder.norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]

# Our fields a Llama-like class fixes (Llama: no window either; Qwen3: QK-norm)
LLAMA_LIKE = {
    "arch": "decoder",
    "attention": "standard",
    "norm_position": "pre",
    "norm": "rmsnorm",
    "position": "rope",
    "ffn": "swiglu",
    "bias": False,
    "scale_embeddings": False,
    "final_norm": True,
    "qk_norm": False,
}
# transformers keys a Llama-like config.json maps onto ours (model_config_from_llama reads them)
LLAMA_LIKE_KEYS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "rms_norm_eps",
    "rope_parameters",
    "tie_word_embeddings",
    "attention_dropout",
)


def llama_like_config(cfg: ModelConfig) -> dict:
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=max_position_embeddings(cfg),
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope_parameters(cfg),
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        attention_dropout=cfg.attention_dropout,
    )


def llama_config(cfg: ModelConfig) -> dict:
    """``LlamaConfig`` keyword arguments equivalent to ``cfg``."""
    reason = LLAMA.incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as LlamaForCausalLM: {reason}")
    return {**llama_like_config(cfg), "attention_bias": False, "mlp_bias": False}


def model_config_from_llama(hf: dict) -> ModelConfig:
    """Our ModelConfig for a Llama ``config.json`` dict. Dynamic NTK starts beyond max_position_embeddings
    (our rope_scaling.original_max_seq_len) and is allowed up to factor times that (our max_seq_len)."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise ValueError(
            f"head_dim={head_dim} is not supported: heads={heads} x head_dim must be hidden_size={hf['hidden_size']}"
        )
    max_len = hf.get("max_position_embeddings", 2048)
    scaling = rope_scaling_from(rope, max_len)
    return build_config(
        arch="decoder",
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_seq_len=math.ceil(max_len * scaling.factor) if scaling and scaling.type == "dynamic" else max_len,
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        position="rope",
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        rope_scaling=scaling.model_dump() if scaling else None,
        ffn="swiglu",
        bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_dropout=hf.get("attention_dropout", 0.0),
    )


def _name_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    return expand_names(GLOBAL_NAMES, LAYER_NAMES + (_QK_NORM_NAMES if cfg.qk_norm else []), cfg.n_layers)


def to_llama_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {theirs: state[ours] for ours, theirs in _name_pairs(cfg)}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight")
    return out


def from_llama_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = {re.sub(r"^model\.model\.", "model.", k): v for k, v in state.items()}
    if cfg.tie_embeddings:
        check_tied_head(state, "lm_head.weight", "model.embed_tokens.weight", "Llama")
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    pairs = _name_pairs(cfg)
    missing = [theirs for _, theirs in pairs if theirs not in state]
    if missing:
        raise ValueError(f"Llama checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    check_leftovers(state, {theirs for _, theirs in pairs}, "Llama")
    return {ours: state[theirs] for ours, theirs in pairs}


LLAMA = Family(
    "Llama",
    "llama",
    "LlamaForCausalLM",
    requires={"attention_window": None, **LLAMA_LIKE},  # (Mistral has a sliding window)
    config=llama_config,
    to_hf=to_llama_state_dict,
    from_hf=from_llama_state_dict,
    model_config=model_config_from_llama,
    mapped=LLAMA_LIKE_KEYS,
    neutral={
        "hidden_act": SILU,
        "attention_bias": Neutral(False, (False,)),
        "mlp_bias": Neutral(False, (False,)),
        "partial_rotary_factor": Neutral(1.0, (1.0,)),
    },
    ignored=("pretraining_tp",),  # (transformers 4 split matrix products into that many slices: the same function)
    not_carried=("dropout", "embedding_dropout"),
)
