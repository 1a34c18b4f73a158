"""Mapping between our decoders and Hugging Face ``transformers`` classes (config and weight names).

Five families map exactly, so ``transformers`` computes the same function with no custom code:

- ``LlamaForCausalLM``: pre-LN, rmsnorm, rope (scaled or not: ``rope_parameters``), swiglu, no biases (MHA, GQA
  or MQA);
- ``MistralForCausalLM``: the same with a sliding window (``sliding_window``, Llama's weight names);
- ``Qwen3ForCausalLM``: Llama with QK-norm (``q_norm``, ``k_norm``), with or without a sliding window in every layer;
- ``GPT2LMHeadModel``: pre-LN, layernorm, learned positions, (exact) gelu, biases, MHA, tied embeddings;
- ``DeepseekV3ForCausalLM``: Llama's layout with multi-head latent attention, every MLP dense
  (``first_k_dense_replace`` = layers); mixture-of-experts layers are refused on import.

Each family is a table (:class:`Family`) of what must hold on each side; a conversion either maps a field
exactly or refuses it with one line naming the field and its value, in both directions (docs/conversions.md).
Close relatives our blocks cannot express are refused with the reason (``UNEXPRESSIBLE``).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import torch

from data_pipeline.tokenizer import load_tokenizer, write_transformers_files
from megatransformer.config import ModelConfig, RopeScaling, validate

# transformers config keys that change nothing a forward pass computes: initialisation, caching, token ids.
IGNORED_KEYS = ("initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id")
# Tensors older transformers saved that are buffers, not weights: never carried, never refused.
_BUFFERS = re.compile(r"(\.rotary_emb\.inv_freq|\.attn\.(masked_)?bias)$")


class Neutral(NamedTuple):
    """A transformers config key we do not carry: its default (when the key is absent) and the values under
    which it changes nothing. Any other value is refused."""

    default: Any
    values: tuple


@dataclass(frozen=True, eq=False)  # (a family is itself: compared and hashed by identity)
class Family:
    """One ``transformers`` class our decoder maps onto exactly, as tables of both sides' fields.

    Export: ``requires`` names our config fields the class fixes and the value it needs (a callable of the config
    for a relation); ``config`` maps the others (but checkpoint.HOW_NOT_WHAT, which change nothing computed);
    ``not_carried`` are our fields that act only in training mode and have no place in the class (exported with
    a note). Import: ``model_config`` maps the keys of ``mapped``; ``neutral`` holds those it cannot carry;
    ``ignored`` (and ``IGNORED_KEYS``) change nothing the class computes; ``weight_options`` reads from a
    ``config.json`` the keyword arguments ``from_hf`` needs besides (DeepSeek's RoPE layout).
    tests/unit/test_hf_fields.py checks that every field of our config and of transformers' config class is in one
    of these tables.
    """

    name: str
    model_type: str
    architecture: str
    requires: dict[str, Any]
    config: Callable[[ModelConfig], dict]
    to_hf: Callable[[dict, ModelConfig], dict]
    from_hf: Callable[[dict, ModelConfig], dict]
    model_config: Callable[[dict], ModelConfig]
    mapped: tuple[str, ...]
    neutral: dict[str, Neutral] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    not_carried: tuple[str, ...] = ()
    weight_options: Callable[[dict], dict] = lambda hf: {}

    def incompatibility(self, cfg: ModelConfig) -> str | None:
        """Why ``cfg`` cannot be this class, or None when it can."""
        for name, needed in self.requires.items():
            needed = needed(cfg) if callable(needed) else needed
            if getattr(cfg, name) != needed:
                return f"model.{name}={getattr(cfg, name)} ({self.name} needs {needed})"
        return None

    def refusal(self, hf: dict) -> str | None:
        """Why a ``config.json`` of this class cannot be ours (a key we cannot carry), or None."""
        for key, neutral in self.neutral.items():
            value = hf.get(key, neutral.default)
            if value not in neutral.values:
                supported = " or ".join(repr(v) for v in neutral.values)
                return f"{self.name} {key}={value!r} is not supported (only {supported})"
        return None

    def notes(self, cfg: ModelConfig) -> list[str]:
        """Our training-only settings this class has no place for (the exported model then computes the same in
        evaluation mode, not in training mode)."""
        return [
            f"model.{name}={getattr(cfg, name)} is not carried: {self.architecture} has no such dropout"
            for name in self.not_carried
            if getattr(cfg, name)
        ]


def _model_config(**fields: Any) -> ModelConfig:
    """Our ModelConfig from mapped fields; a value it refuses is one line (ConfigError, a ValueError)."""
    return validate(fields, ModelConfig)


def _leftover_check(state: dict[str, torch.Tensor], used: set[str], family: str) -> None:
    """Tensors of a checkpoint that no mapped weight takes (a bias, an extra layer) are refused, not dropped."""
    leftover = sorted(name for name in state if name not in used and not _BUFFERS.search(name))
    if leftover:
        raise ValueError(
            f"{family} checkpoint holds {len(leftover)} tensors its config does not describe, e.g. {leftover[0]}"
        )


# ------------------------------------------------------------------------------------------ Llama, Mistral

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
_QK_NORM_NAMES = [
    ("decoder.layers.{i}.self_attn.q_norm.weight", "model.layers.{i}.self_attn.q_norm.weight"),
    ("decoder.layers.{i}.self_attn.k_norm.weight", "model.layers.{i}.self_attn.k_norm.weight"),
]
_GLOBAL_NAMES = [
    ("embed_tokens.weight", "model.embed_tokens.weight"),
    ("decoder.norm.weight", "model.norm.weight"),
    ("lm_head.weight", "lm_head.weight"),
]

# Our fields a Llama-like class fixes (Llama: no window either; Qwen3: QK-norm)
_LLAMA_LIKE = {
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
_LLAMA_LIKE_KEYS = (
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
# the activation ACT2FN runs for these names is SiLU
_SILU = Neutral("silu", ("silu", "swish"))

# transformers' rope_parameters keys of each scaled rope type: (their key, our RopeScaling field). Dynamic NTK's
# trained length is transformers' max_position_embeddings (see model_config_from_llama).
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
# rope_parameters keys that change nothing at these values (transformers' own defaults)
_NEUTRAL_ROPE_KEYS = {"partial_rotary_factor": 1.0}


def rope_parameters(cfg: ModelConfig) -> dict:
    """transformers' ``rope_parameters`` of a rope model."""
    scaling = cfg.rope_scaling
    if scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    keys = {theirs: getattr(scaling, ours) for theirs, ours in _ROPE_KEYS[scaling.type]}
    return {
        "rope_type": scaling.type,
        "rope_theta": cfg.rope_theta,
        **{key: value for key, value in keys.items() if value is not None},
    }


def max_position_embeddings(cfg: ModelConfig) -> int:
    """transformers' ``max_position_embeddings``: for dynamic NTK the trained length where its scaling starts
    (``rope_scaling.original_max_seq_len``), else model.max_seq_len."""
    scaling = cfg.rope_scaling
    return scaling.original_max_seq_len if scaling is not None and scaling.type == "dynamic" else cfg.max_seq_len


def rope_scaling_from(rope: dict, max_positions: int) -> RopeScaling | None:
    """Our rope scaling for transformers' ``rope_parameters`` (or a legacy ``rope_scaling``) dict of a config whose
    ``max_position_embeddings`` is ``max_positions``."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", *_ROPE_KEYS):
        raise ValueError(f"rope_type={rope_type} is not supported (default, {', '.join(_ROPE_KEYS)} are)")
    known = {theirs for theirs, _ in _ROPE_KEYS.get(rope_type, [])} | {"rope_type", "type", "rope_theta"}
    for key, value in rope.items():
        if key in known or value is None or _NEUTRAL_ROPE_KEYS.get(key) == value:
            continue
        if rope_type != "default" or key in _NEUTRAL_ROPE_KEYS:  # (plain RoPE reads no other key)
            raise ValueError(f"rope_type={rope_type} with {key}={value} is not supported")
    if rope_type == "default":
        return None
    fields = {ours: rope[theirs] for theirs, ours in _ROPE_KEYS[rope_type] if rope.get(theirs) is not None}
    if rope_type == "dynamic":  # (its trained length is max_position_embeddings)
        fields["original_max_seq_len"] = max_positions
    elif rope_type in ("yarn", "llama3"):  # (transformers' default where the key is absent)
        fields.setdefault("original_max_seq_len", max_positions)
    return validate({"type": rope_type, **fields}, RopeScaling)


def _llama_like_config(cfg: ModelConfig) -> dict:
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
    return {**_llama_like_config(cfg), "attention_bias": False, "mlp_bias": False}


def mistral_config(cfg: ModelConfig) -> dict:
    """``MistralConfig`` keyword arguments equivalent to ``cfg``."""
    reason = MISTRAL.incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as MistralForCausalLM: {reason}")
    return {**_llama_like_config(cfg), "sliding_window": cfg.attention_window}


def qwen3_config(cfg: ModelConfig) -> dict:
    """``Qwen3Config`` keyword arguments equivalent to ``cfg``."""
    reason = QWEN3.incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as Qwen3ForCausalLM: {reason}")
    window = cfg.attention_window
    return {
        **_llama_like_config(cfg),
        "attention_bias": False,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0,  # (the layers from this one on slide: all of them)
        "layer_types": [("full_attention" if window is None else "sliding_attention")] * cfg.n_layers,
    }


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
    return _model_config(
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


def model_config_from_mistral(hf: dict) -> ModelConfig:
    """Our ModelConfig for a Mistral ``config.json`` dict (transformers' default window: 4096)."""
    cfg = model_config_from_llama(hf).model_dump()
    return _model_config(**{**cfg, "attention_window": hf.get("sliding_window", 4096)})


def model_config_from_qwen3(hf: dict) -> ModelConfig:
    """Our ModelConfig for a Qwen3 ``config.json`` dict."""
    cfg = model_config_from_llama(hf).model_dump()
    return _model_config(**{**cfg, "qk_norm": True, "attention_window": _qwen3_window(hf)})


def _qwen3_window(hf: dict) -> int | None:
    """The sliding window of a Qwen3 config whose every layer slides, None where none does (as transformers
    derives the layers' kinds when ``layer_types`` is absent)."""
    window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
    first_sliding = hf.get("max_window_layers", 28)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if window is not None and i >= first_sliding else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    if set(layer_types) == {"full_attention"}:
        return None
    if set(layer_types) == {"sliding_attention"} and window is not None:
        return window
    raise ValueError(
        f"Qwen3 layer_types={layer_types!r} with use_sliding_window={hf.get('use_sliding_window', False)} is not "
        "supported (a sliding window in every layer or in none)"
    )


def _pairs(global_names: list, layer_names: list, n_layers: int) -> list[tuple[str, str]]:
    pairs = list(global_names)
    for i in range(n_layers):
        pairs += [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in layer_names]
    return pairs


def _name_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    return _pairs(_GLOBAL_NAMES, _LAYER_NAMES + (_QK_NORM_NAMES if cfg.qk_norm else []), cfg.n_layers)


def to_llama_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {theirs: state[ours] for ours, theirs in _name_pairs(cfg)}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight")
    return out


def from_llama_state_dict(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    state = {re.sub(r"^model\.model\.", "model.", k): v for k, v in state.items()}
    if cfg.tie_embeddings:
        state = {**state, "lm_head.weight": state["model.embed_tokens.weight"]}
    pairs = _name_pairs(cfg)
    missing = [theirs for _, theirs in pairs if theirs not in state]
    if missing:
        raise ValueError(f"Llama checkpoint lacks {len(missing)} tensors, e.g. {missing[0]}")
    _leftover_check(state, {theirs for _, theirs in pairs}, "Llama")
    return {ours: state[theirs] for ours, theirs in pairs}


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
    return _model_config(
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
    used = {theirs for _, theirs in pairs} | {"lm_head.weight"}  # (tied: transformers reads the embedding)
    for i in range(cfg.n_layers):
        linears = [f"transformer.h.{i}.attn.c_attn"] + [theirs.format(i=i) for _, theirs in _GPT2_LINEARS]
        used |= {f"{name}.{kind}" for name in linears for kind in ("weight", "bias")}
    _leftover_check(state, used, "GPT-2")
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
_LATENT_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")  # both sides'
# DeepSeek-V3's mixture-of-experts settings: they act only in MoE layers, which are refused (first_k_dense_replace)
_DEEPSEEK_MOE_KEYS = (
    "moe_intermediate_size",
    "n_group",
    "n_routed_experts",
    "n_shared_experts",
    "norm_topk_prob",
    "num_experts_per_tok",
    "output_router_logits",
    "routed_scaling_factor",
    "topk_group",
)


def deepseek_config(cfg: ModelConfig) -> dict:
    """``DeepseekV3Config`` keyword arguments equivalent to ``cfg``: every layer's MLP dense
    (``first_k_dense_replace`` = layers), RoPE in the half-split layout (``rope_interleave`` false)."""
    reason = DEEPSEEK_V3.incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as DeepseekV3ForCausalLM: {reason}")
    return {
        **_llama_like_config(cfg),
        "head_dim": cfg.qk_rope_head_dim,  # (what DeepseekV3Config itself sets: the rotary width)
        **{name: getattr(cfg, name) for name in _LATENT_FIELDS},
        "first_k_dense_replace": cfg.n_layers,
        "rope_interleave": False,
        "attention_bias": False,
        "num_mtp_layers": 0,
    }


def model_config_from_deepseek(hf: dict) -> ModelConfig:
    """Our ModelConfig for a DeepSeek-V3 ``config.json`` dict whose layers are all dense."""
    layers, dense = hf["num_hidden_layers"], hf.get("first_k_dense_replace", 3)
    if dense < layers:
        raise ValueError(
            f"DeepSeek-V3 first_k_dense_replace={dense} < num_hidden_layers={layers}: layers {dense}-{layers - 1} "
            "are mixture-of-experts layers, which megatransformer does not build"
        )
    heads = hf["num_attention_heads"]
    if hf.get("num_key_value_heads", heads) != heads:
        raise ValueError(f"DeepSeek-V3 num_key_value_heads={hf['num_key_value_heads']} != num_attention_heads={heads}")
    rope = hf.get("qk_rope_head_dim", 64)
    if hf.get("head_dim", rope) != rope:
        raise ValueError(f"DeepSeek-V3 head_dim={hf['head_dim']} is not supported: it is the RoPE width, {rope}")
    defaults = {"kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128}
    latent = {name: hf.get(name, defaults.get(name, 128)) for name in _LATENT_FIELDS}
    llama = model_config_from_llama({**hf, "head_dim": None}).model_dump()  # (its head_dim: the rotary width)
    return _model_config(**{**llama, "n_kv_heads": None, "attention": "mla", **latent})


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
    mtp = re.compile(r"^model\.layers\.(\d+)\.")  # (layers from num_hidden_layers on: multi-token prediction)
    extra = {name for name in state if (m := mtp.match(name)) and int(m.group(1)) >= cfg.n_layers}
    _leftover_check(state, {theirs for _, theirs in pairs} | extra, "DeepSeek-V3")
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


LLAMA = Family(
    "Llama",
    "llama",
    "LlamaForCausalLM",
    requires={"attention_window": None, **_LLAMA_LIKE},  # (Mistral has a sliding window)
    config=llama_config,
    to_hf=to_llama_state_dict,
    from_hf=from_llama_state_dict,
    model_config=model_config_from_llama,
    mapped=_LLAMA_LIKE_KEYS,
    neutral={
        "hidden_act": _SILU,
        "attention_bias": Neutral(False, (False,)),
        "mlp_bias": Neutral(False, (False,)),
        "partial_rotary_factor": Neutral(1.0, (1.0,)),
    },
    ignored=("pretraining_tp",),  # (transformers 4 split matrix products into that many slices: the same function)
    not_carried=("dropout", "embedding_dropout"),
)
MISTRAL = Family(
    "Mistral",
    "mistral",
    "MistralForCausalLM",
    requires=_LLAMA_LIKE,
    config=mistral_config,
    to_hf=to_llama_state_dict,
    from_hf=from_llama_state_dict,
    model_config=model_config_from_mistral,
    mapped=(*_LLAMA_LIKE_KEYS, "sliding_window"),
    neutral={"hidden_act": _SILU, "partial_rotary_factor": Neutral(1.0, (1.0,))},
    not_carried=("dropout", "embedding_dropout"),
)
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
QWEN3 = Family(
    "Qwen3",
    "qwen3",
    "Qwen3ForCausalLM",
    requires={**_LLAMA_LIKE, "qk_norm": True},
    config=qwen3_config,
    to_hf=to_llama_state_dict,
    from_hf=from_llama_state_dict,
    model_config=model_config_from_qwen3,
    mapped=(*_LLAMA_LIKE_KEYS, "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
    neutral={
        "hidden_act": _SILU,
        "attention_bias": Neutral(False, (False,)),
        "partial_rotary_factor": Neutral(1.0, (1.0,)),
    },
    not_carried=("dropout", "embedding_dropout"),
)
DEEPSEEK_V3 = Family(
    "DeepSeek-V3",
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    requires={**_LLAMA_LIKE, "attention": "mla", "attention_window": None},
    config=deepseek_config,
    to_hf=to_deepseek_state_dict,
    from_hf=from_deepseek_state_dict,
    model_config=model_config_from_deepseek,
    mapped=(*_LLAMA_LIKE_KEYS, *_LATENT_FIELDS, "first_k_dense_replace", "rope_interleave"),
    neutral={
        "hidden_act": _SILU,
        "attention_bias": Neutral(False, (False,)),
        "partial_rotary_factor": Neutral(1.0, (1.0,)),
    },
    ignored=(*_DEEPSEEK_MOE_KEYS, "num_mtp_layers", "pretraining_tp"),  # (transformers runs no MTP layer either)
    not_carried=("dropout", "embedding_dropout"),
    weight_options=lambda hf: {"interleaved": hf.get("rope_interleave", True)},
)
FAMILIES = (LLAMA, MISTRAL, GPT2, QWEN3, DEEPSEEK_V3)
# transformers families close to ours that our blocks cannot express, and why
UNEXPRESSIBLE = {
    "olmo2": "OLMo 2 normalises each sub-layer's output inside the residual (x + norm(f(x))) and its QK-norm spans "
    "all heads at once (one weight of heads x head_dim); our blocks normalise before (pre-LN) or after the sum "
    "(post-LN) and QK-norm per head as Qwen3 does (model.qk_norm exports as Qwen3ForCausalLM)",
}


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
    family: Family | None = None,
) -> Family:
    """Write a ``transformers`` model directory (config.json, model.safetensors, tokenizer files) that loads with
    no custom code, for ``family`` (default: the first one ``cfg`` maps onto). Written to a temporary directory,
    renamed when complete."""
    from megatransformer.checkpoint import save_safetensors

    family = family or hf_family(cfg)
    special_ids = special_ids or {}
    config = {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        **family.config(cfg),
        # (rope_theta where older transformers read it)
        **({"rope_theta": cfg.rope_theta} if family in (LLAMA, MISTRAL, QWEN3, DEEPSEEK_V3) else {}),
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
    """Read a Llama, Mistral, Qwen3, GPT-2 or DeepSeek-V3 directory (config.json + *.safetensors, possibly sharded)
    into our names."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    config_path = Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} has no config.json; expected a Hugging Face model directory")
    try:
        hf = json.loads(config_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{config_path} is not JSON ({err})") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path} holds a JSON {type(hf).__name__}; a model's config is a JSON object")
    if hf.get("model_type") in UNEXPRESSIBLE:
        raise ValueError(f"{path} holds model_type={hf['model_type']!r}: {UNEXPRESSIBLE[hf['model_type']]}")
    family = next((f for f in FAMILIES if f.model_type == hf.get("model_type")), None)
    if family is None:
        raise ValueError(
            f"{path} holds model_type={hf.get('model_type')!r}; only "
            f"{', '.join(repr(f.model_type) for f in FAMILIES)} can be imported"
        )
    reason = family.refusal(hf)
    if reason:
        raise ValueError(f"{path}: {reason}")
    try:
        cfg = family.model_config(hf)
    except KeyError as err:
        raise ValueError(f"{config_path} lacks {err.args[0]!r}, which a {family.name} config holds") from None
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path} has no .safetensors weights (convert .bin weights with transformers first)")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file)))
        except (SafetensorError, OSError) as err:
            raise ValueError(f"{file} is not a readable safetensors file ({err}); download it again") from None
    weights = family.from_hf(state, cfg, **family.weight_options(hf))
    _check_shapes(weights, cfg, path)
    return cfg, weights


def _check_shapes(weights: dict[str, torch.Tensor], cfg: ModelConfig, path: Path) -> None:
    """Weights of other shapes than the config describes are refused here, not when a run loads them."""
    from megatransformer.model import build_model

    with torch.device("meta"):
        expected = build_model(cfg).state_dict()
    for name, tensor in weights.items():
        if tensor.shape != expected[name].shape:
            raise ValueError(
                f"{path}: weight {name} is {list(tensor.shape)}, its config.json describes {list(expected[name].shape)}"
            )
