"""Mapping between our decoders and Hugging Face ``transformers`` classes (config and weight names).

Four families map exactly, so ``transformers`` computes the same function with no custom code:

- ``LlamaForCausalLM``: pre-LN, rmsnorm, rope (scaled or not: ``rope_parameters``), swiglu, no biases (MHA, GQA
  or MQA);
- ``MistralForCausalLM``: the same with a sliding window (``sliding_window``, Llama's weight names);
- ``GPT2LMHeadModel``: pre-LN, layernorm, learned positions, (exact) gelu, biases, MHA, tied embeddings;
- ``DeepseekV3ForCausalLM``: Llama's layout with multi-head latent attention, every MLP dense
  (``first_k_dense_replace`` = layers); mixture-of-experts layers are refused on import.

Anything else is refused with the option that prevents each mapping.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from data_pipeline.tokenizer import load_tokenizer, write_transformers_files
from megatransformer.config import ModelConfig, RopeScaling

# (our name, Llama name) templates; {i} is the layer index
_LAYER_NAMES = [
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
_GLOBAL_NAMES = [
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("decoder.norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]


def _llama_like_incompatibility(cfg: ModelConfig, family: str, attention: str = "standard") -> str | None:
    required = {
        "arch": "decoder",
        "attention": attention,
        "norm_position": "pre",
        "norm": "rmsnorm",
        "position": "rope",
        "ffn": "swiglu",
        "bias": False,
        "scale_embeddings": False,
        "final_norm": True,
    }
    for field, value in required.items():
        if getattr(cfg, field) != value:
            return f"model.{field}={getattr(cfg, field)} ({family} needs {value})"
    return None


def llama_incompatibility(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be a LlamaForCausalLM, or None when it can."""
    if cfg.attention_window is not None:
        return f"model.attention_window={cfg.attention_window} (Llama has no sliding window; Mistral has)"
    return _llama_like_incompatibility(cfg, "Llama")


def mistral_incompatibility(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be a MistralForCausalLM, or None when it can."""
    return _llama_like_incompatibility(cfg, "Mistral")


# transformers' rope_parameters keys of each scaled rope type: (their key, our RopeScaling field)
_ROPE_KEYS = {
    "linear": [("factor", "factor")],
    "dynamic": [("factor", "factor")],
    "yarn": [
        ("factor", "factor"),
        ("original_max_position_embeddings", "original_max_seq_len"),
        ("beta_fast", "beta_fast"),
        ("beta_slow", "beta_slow"),
        ("attention_factor", "attention_factor"),
        ("truncate", "truncate"),
    ],
    "llama3": [
        ("factor", "factor"),
        ("original_max_position_embeddings", "original_max_seq_len"),
        ("low_freq_factor", "low_freq_factor"),
        ("high_freq_factor", "high_freq_factor"),
    ],
}


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' ``rope_parameters`` of a rope model (dynamic scaling extends beyond
    max_position_embeddings, which is model.max_seq_len)."""
    scaling = cfg.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    keys = {theirs: getattr(scaling, ours) for theirs, ours in _ROPE_KEYS[scaling.type]}
    return {
        "rope_type": scaling.type,
        "rope_theta": cfg.rope_theta,
        **{key: value for key, value in keys.items() if value is not None},
    }


def rope_scaling_from(rope: dict) -> RopeScaling | None:
    """Our rope scaling for transformers' ``rope_parameters`` (or a legacy ``rope_scaling``) dict."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type not in _ROPE_KEYS:
        raise ValueError(f"rope_type={rope_type} is not supported (default, {', '.join(_ROPE_KEYS)} are)")
    known = {theirs for theirs, _ in _ROPE_KEYS[rope_type]} | {"rope_type", "type", "rope_theta"}
    unknown = sorted(key for key, value in rope.items() if key not in known and value is not None)
    if unknown:
        raise ValueError(f"rope_type={rope_type} with {', '.join(unknown)} is not supported")
    return RopeScaling(
        type=rope_type, **{ours: rope[theirs] for theirs, ours in _ROPE_KEYS[rope_type] if rope.get(theirs) is not None}
    )


def llama_config(cfg: ModelConfig) -> dict:
    """``LlamaConfig`` keyword arguments equivalent to ``cfg``."""
    reason = llama_incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as LlamaForCausalLM: {reason}")
    return {**_llama_like_config(cfg), "attention_bias": False, "mlp_bias": False}


def _llama_like_config(cfg: ModelConfig) -> dict:
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.d_ff,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_parameters=rope_parameters(cfg),
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        attention_dropout=cfg.attention_dropout,
    )


def mistral_config(cfg: ModelConfig) -> dict:
    """``MistralConfig`` keyword arguments equivalent to ``cfg``."""
    reason = mistral_incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as MistralForCausalLM: {reason}")
    return {**_llama_like_config(cfg), "sliding_window": cfg.attention_window}


def model_config_from_llama(hf: dict) -> ModelConfig:
    """Our ModelConfig for a Llama ``config.json`` dict."""
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    if head_dim * heads != hf["hidden_size"]:
        raise ValueError(f"Llama head_dim={head_dim} x heads={heads} != hidden_size={hf['hidden_size']}")
    return ModelConfig(
        arch="decoder",
        d_model=hf["hidden_size"],
        n_layers=hf["num_hidden_layers"],
        n_heads=heads,
        n_kv_heads=hf.get("num_key_value_heads") or heads,
        d_ff=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_seq_len=hf.get("max_position_embeddings", 2048),
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        position="rope",
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        rope_scaling=rope_scaling_from(rope),
        ffn="swiglu",
        bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def model_config_from_mistral(hf: dict) -> ModelConfig:
    """Our ModelConfig for a Mistral ``config.json`` dict (transformers' default window: 4096)."""
    return model_config_from_llama(hf).model_copy(update={"attention_window": hf.get("sliding_window", 4096)})


def _pairs(global_names: list, layer_names: list, n_layers: int) -> list[tuple[str, str]]:
    pairs = list(global_names)
    for i in range(n_layers):
        pairs += [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in layer_names]
    return pairs


def _name_pairs(n_layers: int) -> list[tuple[str, str]]:
    return _pairs(_GLOBAL_NAMES, _LAYER_NAMES, n_layers)


def to_llama_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {theirs: state[ours] for ours, theirs in _name_pairs(cfg.n_layers)}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight")
    return out


def from_llama_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = {re.sub(r"^model\.model\.", "model.", k): v for k, v in state.items()}
    if cfg.tie_embeddings:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    missing = [theirs for _, theirs in _name_pairs(cfg.n_layers) if theirs not in state]
    if missing:
        raise ValueError(f"Llama checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    return {ours: state[theirs] for ours, theirs in _name_pairs(cfg.n_layers)}


# ------------------------------------------------------------------------------------------------ GPT-2

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


def gpt2_incompatibility(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be a GPT2LMHeadModel, or None when it can."""
    required = {
        "arch": "decoder",
        "norm_position": "pre",
        "norm": "layernorm",
        "position": "learned",
        "ffn": "gelu",
        "bias": True,
        "scale_embeddings": False,
        "final_norm": True,
        "tie_embeddings": True,
        "kv_heads": cfg.n_heads,
        "attention_window": None,
        "attention": "standard",
    }
    for field, value in required.items():
        if getattr(cfg, field) != value:
            return f"model.{field.replace('kv_heads', 'n_kv_heads')}={getattr(cfg, field)} (GPT-2 needs {value})"
    return None


def gpt2_config(cfg: ModelConfig) -> dict:
    """``GPT2Config`` keyword arguments equivalent to ``cfg``."""
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
    """Our ModelConfig for a GPT-2 ``config.json`` dict."""
    activation = hf.get("activation_function", "gelu_new")
    if activation != "gelu":
        raise ValueError(
            f"GPT-2 activation_function={activation!r} is not supported (only exact 'gelu'; "
            "'gelu_new' is the tanh approximation)"
        )
    for flag in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn"):
        if hf.get(flag):
            raise ValueError(f"GPT-2 {flag}=true is not supported")
    return ModelConfig(
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
    )


def to_gpt2_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {theirs: state[ours] for ours, theirs in _pairs(_GPT2_GLOBAL_NAMES, _GPT2_LAYER_NAMES, cfg.n_layers)}
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
    pairs = _pairs(_GPT2_GLOBAL_NAMES, _GPT2_LAYER_NAMES, cfg.n_layers)
    needed = [theirs for _, theirs in pairs] + [f"transformer.h.{i}.attn.c_attn.weight" for i in range(cfg.n_layers)]
    missing = [name for name in needed if name not in state]
    if missing:
        raise ValueError(f"GPT-2 checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
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
    return out


# ------------------------------------------------------------------------------------------ DeepSeek-V3

_DEEPSEEK_LAYER_NAMES = [  # besides Llama's norms and MLP; the attention's (ours, DeepSeek) suffixes
    ("q_proj", "q_proj"),
    ("q_a_proj", "q_a_proj"),
    ("q_a_norm", "q_a_layernorm"),
    ("q_b_proj", "q_b_proj"),
    ("kv_a_proj", "kv_a_proj_with_mqa"),
    ("kv_a_norm", "kv_a_layernorm"),
    ("kv_b_proj", "kv_b_proj"),
    ("o_proj", "o_proj"),
]


def deepseek_incompatibility(cfg: ModelConfig) -> str | None:
    """Why ``cfg`` cannot be a DeepseekV3ForCausalLM (dense MLP in every layer), or None when it can."""
    if cfg.attention_window is not None:
        return f"model.attention_window={cfg.attention_window} (DeepSeek-V3 has no sliding window)"
    return _llama_like_incompatibility(cfg, "DeepSeek-V3", attention="mla")


def deepseek_config(cfg: ModelConfig) -> dict:
    """``DeepseekV3Config`` keyword arguments equivalent to ``cfg``: every layer's MLP dense
    (``first_k_dense_replace`` = layers), RoPE in the half-split layout (``rope_interleave`` false)."""
    reason = deepseek_incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as DeepseekV3ForCausalLM: {reason}")
    return {
        **_llama_like_config(cfg),
        "head_dim": cfg.qk_rope_head_dim,  # (what DeepseekV3Config itself sets: the rotary width)
        "kv_lora_rank": cfg.kv_lora_rank,
        "q_lora_rank": cfg.q_lora_rank,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "first_k_dense_replace": cfg.n_layers,
        "rope_interleave": False,
        "attention_bias": False,
        "num_mtp_layers": 0,
    }


# DeepSeek-V3 config keys for what we do not build, with the value that leaves it out
_DEEPSEEK_ABSENT = {"attention_bias": False}


def model_config_from_deepseek(hf: dict) -> ModelConfig:
    """Our ModelConfig for a DeepSeek-V3 ``config.json`` dict whose layers are all dense."""
    layers = hf["num_hidden_layers"]
    dense = hf.get("first_k_dense_replace", 3)
    if dense < layers and hf.get("n_routed_experts", 256):
        raise ValueError(
            f"DeepSeek-V3 first_k_dense_replace={dense} < num_hidden_layers={layers}: layers {dense}-{layers - 1} "
            "are mixture-of-experts layers, which megatransformer does not build"
        )
    for key, value in _DEEPSEEK_ABSENT.items():
        if hf.get(key, value) != value:
            raise ValueError(f"DeepSeek-V3 {key}={hf[key]} is not supported (only {value})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"DeepSeek-V3 hidden_act={hf['hidden_act']!r} is not supported (only 'silu')")
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"DeepSeek-V3 num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads={heads}")
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    try:
        scaling = rope_scaling_from(rope)
    except ValueError as err:
        raise ValueError(f"DeepSeek-V3 {err}") from None
    return ModelConfig(
        arch="decoder",
        d_model=hf["hidden_size"],
        n_layers=layers,
        n_heads=heads,
        d_ff=hf["intermediate_size"],
        vocab_size=hf["vocab_size"],
        max_seq_len=hf.get("max_position_embeddings", 4096),
        norm="rmsnorm",
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        position="rope",
        rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        ffn="swiglu",
        bias=False,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        attention_dropout=hf.get("attention_dropout", 0.0),
        attention="mla",
        kv_lora_rank=hf.get("kv_lora_rank", 512),
        q_lora_rank=hf.get("q_lora_rank", 1536),
        qk_rope_head_dim=hf.get("qk_rope_head_dim", 64),
        qk_nope_head_dim=hf.get("qk_nope_head_dim", 128),
        v_head_dim=hf.get("v_head_dim", 128),
    )


def _deepseek_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    attention = [
        (f"decoder.layers.{{i}}.self_attn.{ours}.weight", f"model.layers.{{i}}.self_attn.{theirs}.weight")
        for ours, theirs in _DEEPSEEK_LAYER_NAMES
        if (ours == "q_proj") == (cfg.q_lora_rank is None) or not ours.startswith("q_")
    ]
    mlp_and_norms = [pair for pair in _LAYER_NAMES if ".self_attn." not in pair[0]]
    return _pairs(_GLOBAL_NAMES, mlp_and_norms + attention, cfg.n_layers)


def to_deepseek_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {theirs: state[ours] for ours, theirs in _deepseek_pairs(cfg)}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight")
    return out


def from_deepseek_state_dict(
    state: dict[str, torch.Tensor], cfg: ModelConfig, interleaved: bool = False
) -> dict[str, torch.Tensor]:
    """Our weights from DeepSeek-V3's; ``interleaved`` (``rope_interleave``): RoPE pairs (x0, x1), (x2, x3), ...
    whose rotation equals the half-split one of (x0, x2, ..., x1, x3, ...), so the rows that make the RoPE
    slice are reordered that way. The multi-token-prediction layers (beyond num_hidden_layers), which
    transformers does not run either, are left out."""
    if cfg.tie_embeddings:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    pairs = _deepseek_pairs(cfg)
    missing = [theirs for _, theirs in pairs if theirs not in state]
    if missing:
        raise ValueError(f"DeepSeek-V3 checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    out = {ours: state[theirs] for ours, theirs in pairs}
    if interleaved:
        rope, nope = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
        half_split = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
        for i in range(cfg.n_layers):
            attn = f"decoder.layers.{i}.self_attn."
            q = f"{attn}q_proj.weight" if cfg.q_lora_rank is None else f"{attn}q_b_proj.weight"
            heads = out[q].view(cfg.n_heads, nope + rope, -1)
            out[q] = torch.cat([heads[:, :nope], heads[:, nope:][:, half_split]], dim=1).flatten(0, 1)
            kv = out[f"{attn}kv_a_proj.weight"]
            out[f"{attn}kv_a_proj.weight"] = torch.cat([kv[: cfg.kv_lora_rank], kv[cfg.kv_lora_rank :][half_split]])
    return out


# ------------------------------------------------------------------------------------------- families


@dataclass(frozen=True)
class Family:
    """One ``transformers`` class our decoder maps onto exactly."""

    name: str
    model_type: str
    architecture: str
    incompatibility: Callable[[ModelConfig], str | None]
    config: Callable[[ModelConfig], dict]
    to_hf: Callable[[dict, ModelConfig], dict]
    from_hf: Callable[[dict, ModelConfig], dict]
    model_config: Callable[[dict], ModelConfig]


LLAMA = Family(
    "Llama",
    "llama",
    "LlamaForCausalLM",
    llama_incompatibility,
    llama_config,
    to_llama_state_dict,
    from_llama_state_dict,
    model_config_from_llama,
)
MISTRAL = Family(
    "Mistral",
    "mistral",
    "MistralForCausalLM",
    mistral_incompatibility,
    mistral_config,
    to_llama_state_dict,
    from_llama_state_dict,
    model_config_from_mistral,
)
GPT2 = Family(
    "GPT-2",
    "gpt2",
    "GPT2LMHeadModel",
    gpt2_incompatibility,
    gpt2_config,
    to_gpt2_state_dict,
    from_gpt2_state_dict,
    model_config_from_gpt2,
)
DEEPSEEK_V3 = Family(
    "DeepSeek-V3",
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    deepseek_incompatibility,
    deepseek_config,
    to_deepseek_state_dict,
    from_deepseek_state_dict,
    model_config_from_deepseek,
)
FAMILIES = (LLAMA, MISTRAL, GPT2, DEEPSEEK_V3)


def hf_incompatibility(cfg: ModelConfig) -> str | None:
    """None when some family can express ``cfg``, else each family's reason."""
    reasons = [reason for family in FAMILIES if (reason := family.incompatibility(cfg))]
    return "; ".join(reasons) if len(reasons) == len(FAMILIES) else None


def hf_family(cfg: ModelConfig) -> Family:
    for family in FAMILIES:
        if family.incompatibility(cfg) is None:
            return family
    raise ValueError(f"this model maps onto no transformers class: {hf_incompatibility(cfg)}")


def save_hf_dir(
    out: Path,
    cfg: ModelConfig,
    state: dict[str, torch.Tensor],
    tokenizer_json: Path | None = None,
    special_ids: dict[str, int | None] | None = None,
    dtype: torch.dtype = torch.float32,
) -> Family:
    """Write a ``transformers`` model directory (config.json, model.safetensors, tokenizer files) that loads with
    no custom code, for the family ``cfg`` maps onto. Written to a temporary directory, renamed when complete."""
    from megatransformer.checkpoint import save_safetensors

    family = hf_family(cfg)
    special_ids = special_ids or {}
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        **family.config(cfg),
        # where older transformers read it
        **({"rope_theta": cfg.rope_theta} if family in (LLAMA, MISTRAL, DEEPSEEK_V3) else {}),
        "bos_token_id": special_ids.get("bos"),
        "eos_token_id": special_ids.get("eos"),
        "pad_token_id": special_ids.get("pad"),
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tensors = {k: v.detach().to(dtype).contiguous().clone() for k, v in family.to_hf(state, cfg).items()}
    save_safetensors(tensors, tmp / "model.safetensors")
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    (tmp / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": special_ids.get("bos"),
                "eos_token_id": special_ids.get("eos"),
                "pad_token_id": special_ids.get("pad"),
            },
            indent=2,
        )
    )
    if tokenizer_json is not None:
        shutil.copyfile(tokenizer_json, tmp / "tokenizer.json")
        write_transformers_files(load_tokenizer(tmp / "tokenizer.json"), tmp, model_max_length=cfg.max_seq_len)
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return family


def load_hf_dir(path: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a Llama, Mistral, GPT-2 or DeepSeek-V3 directory (config.json + *.safetensors, possibly sharded) into
    our names."""
    from safetensors.torch import load_file

    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} has no config.json; expected a Hugging Face model directory")
    hf = json.loads(config_path.read_text())
    family = next((f for f in FAMILIES if f.model_type == hf.get("model_type")), None)
    if family is None:
        raise ValueError(
            f"{path} holds model_type={hf.get('model_type')!r}; only "
            f"{', '.join(repr(f.model_type) for f in FAMILIES)} can be imported"
        )
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors weights (convert .bin weights with transformers first)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        state.update(load_file(str(file)))
    cfg = family.model_config(hf)
    if family is DEEPSEEK_V3:
        return cfg, from_deepseek_state_dict(state, cfg, interleaved=hf.get("rope_interleave", True))
    return cfg, family.from_hf(state, cfg)
