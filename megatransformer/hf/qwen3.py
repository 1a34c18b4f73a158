"""``Qwen3ForCausalLM``: Llama with QK-norm, with or without a sliding window in every layer."""

from __future__ import annotations

from megatransformer.config import ModelConfig
from megatransformer.hf.family import SILU, Family, Neutral, build_config
from megatransformer.hf.llama import LLAMA, LLAMA_LIKE, LLAMA_LIKE_KEYS, llama_like_config, model_config_from_llama


def qwen3_config(cfg: ModelConfig) -> dict:
    """``Qwen3Config`` keyword arguments equivalent to ``cfg``."""
    reason = QWEN3.incompatibility(cfg)
    if reason:
        raise ValueError(f"this model cannot be expressed as Qwen3ForCausalLM: {reason}")
    window = cfg.attention_window
    return {
        **llama_like_config(cfg),
        "attention_bias": False,
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0,  # (the layers from this one on slide: all of them)
        "layer_types": [("full_attention" if window is None else "sliding_attention")] * cfg.n_layers,
    }


def model_config_from_qwen3(hf: dict) -> ModelConfig:
    """Our ModelConfig for a Qwen3 ``config.json`` dict."""
    cfg = model_config_from_llama(hf).model_dump()
    return build_config(**{**cfg, "qk_norm": True, "attention_window": _qwen3_window(hf)})


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


QWEN3 = Family(
    "Qwen3",
    "qwen3",
    "Qwen3ForCausalLM",
    requires={**LLAMA_LIKE, "qk_norm": True},
    config=qwen3_config,
    to_hf=LLAMA.to_hf,  # (Llama's weight names)
    from_hf=LLAMA.from_hf,
    model_config=model_config_from_qwen3,
    mapped=(*LLAMA_LIKE_KEYS, "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"),
    neutral={
        "hidden_act": SILU,
        "attention_bias": Neutral(False, (False,)),
        "partial_rotary_factor": Neutral(1.0, (1.0,)),
    },
    not_carried=("dropout", "embedding_dropout"),
)
