"""``DeepseekV3ForCausalLM``: Llama's layout with multi-head latent attention, every MLP dense; mixture-of-experts
layers are refused on import."""

from __future__ import annotations

import re

import torch

from megatransformer.config import ModelConfig
from megatransformer.hf.family import SILU, Family, Neutral, build_config, check_leftovers, expand_names
from megatransformer.hf.llama import (
    GLOBAL_NAMES,
    LAYER_NAMES,
    LLAMA_LIKE,
    LLAMA_LIKE_KEYS,
    llama_like_config,
    model_config_from_llama,
)

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
        **llama_like_config(cfg),
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
    return build_config(**{**llama, "n_kv_heads": None, "attention": "mla", **latent})


def _deepseek_pairs(cfg: ModelConfig) -> list[tuple[str, str]]:
    attention = [
        (f"decoder.layers.{{i}}.self_attn.{ours}.weight", f"model.layers.{{i}}.self_attn.{theirs}.weight")
        for ours, theirs in _DEEPSEEK_LAYER_NAMES
        if (ours == "q_proj") == (cfg.q_lora_rank is None) or not ours.startswith("q_")
    ]
    mlp_and_norms = [pair for pair in LAYER_NAMES if ".self_attn." not in pair[0]]
    return expand_names(GLOBAL_NAMES, mlp_and_norms + attention, cfg.n_layers)


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
    check_leftovers(state, {theirs for _, theirs in pairs} | extra, "DeepSeek-V3")
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


DEEPSEEK_V3 = Family(
    "DeepSeek-V3",
    "deepseek_v3",
    "DeepseekV3ForCausalLM",
    requires={**LLAMA_LIKE, "attention": "mla", "attention_window": None},
    config=deepseek_config,
    to_hf=to_deepseek_state_dict,
    from_hf=from_deepseek_state_dict,
    model_config=model_config_from_deepseek,
    mapped=(*LLAMA_LIKE_KEYS, *_LATENT_FIELDS, "first_k_dense_replace", "rope_interleave"),
    neutral={
        "hidden_act": SILU,
        "attention_bias": Neutral(False, (False,)),
        "partial_rotary_factor": Neutral(1.0, (1.0,)),
    },
    ignored=(*_DEEPSEEK_MOE_KEYS, "num_mtp_layers", "pretraining_tp"),  # (transformers runs no MTP layer either)
    not_carried=("dropout", "embedding_dropout"),
    weight_options=lambda hf: {"interleaved": hf.get("rope_interleave", True)},
)
