"""``MistralForCausalLM``: Llama with a sliding window (Llama's weight names)."""

from __future__ import annotations

from megatransformer.config import ModelConfig
from megatransformer.hf.family import SILU, Family, Neutral, build_config
from megatransformer.hf.llama import LLAMA, LLAMA_LIKE, LLAMA_LIKE_KEYS, llama_like_config, model_config_from_llama


def mistral_config(cfg: ModelConfig) -> dict:
    """``MistralConfig`` keyword arguments equivalent to ``cfg``."""
    reason = MISTRAL.incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as MistralForCausalLM: {reason}")
    return {**llama_like_config(cfg), "sliding_window": cfg.attention_window}


def model_config_from_mistral(hf: dict) -> ModelConfig:
    """Our ModelConfig for a Mistral ``config.json`` dict (transformers' default window: 4096)."""
    cfg = model_config_from_llama(hf).model_dump()
    return build_config(**{**cfg, "attention_window": hf.get("sliding_window", 4096)})


MISTRAL = Family(
    "Mistral",
    "mistral",
    "MistralForCausalLM",
    requires=LLAMA_LIKE,
    config=mistral_config,
    to_hf=LLAMA.to_hf,  # (Llama's weight names)
    from_hf=LLAMA.from_hf,
    model_config=model_config_from_mistral,
    mapped=(*LLAMA_LIKE_KEYS, "sliding_window"),
    neutral={"hidden_act": SILU, "partial_rotary_factor": Neutral(1.0, (1.0,))},
    not_carried=("dropout", "embedding_dropout"),
)
