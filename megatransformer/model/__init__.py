"""The model family. ``build_model(cfg.model)`` is the entry point (``construct``: made without initial values, for
weights to load); ``TP_PLAN`` the tensor-parallel plan."""

from megatransformer.model.attention import BACKENDS, KVCache
from megatransformer.model.generate import generate, stream
from megatransformer.model.tp_plan import TP_PLAN
from megatransformer.model.transformer import (
    ARCHITECTURES,
    DecoderLM,
    EncoderDecoderLM,
    EncoderLM,
    LanguageModel,
    build_model,
    construct,
)

__all__ = [
    "ARCHITECTURES",
    "BACKENDS",
    "DecoderLM",
    "EncoderDecoderLM",
    "EncoderLM",
    "KVCache",
    "LanguageModel",
    "TP_PLAN",
    "build_model",
    "construct",
    "generate",
    "stream",
]
