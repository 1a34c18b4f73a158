"""What can be checked before DeepSpeed starts, is: a run that cannot work on this machine or with these
files fails within seconds, with one line and exit code 2, and leaves no run directory behind.

The schema (``megatransformer.config``) has already checked every value on its own and against the others;
here the config meets the machine (CUDA, flash-attn) and the files (tokenizer, shard manifests). Engine
start-up takes seconds to minutes, and a first forward pass that fails prints a traceback from each rank.
"""

from __future__ import annotations

import os

import torch

from data_pipeline.loader import check_data as check_shards
from data_pipeline.tokenizer import TokenizerInfo
from megatransformer.config import ConfigError, RunConfig, precision_dtype
from megatransformer.model import gpu_cores
from megatransformer.model.attention import FLASH_ATTN_INSTALL, flash_attn_module
from megatransformer.training.data import loader_settings
from megatransformer.training.observability.trackers import check_tensorboard
from megatransformer.training.runtime.layout import data_parallel_size, resolve_batch_sizes


def check_before_start(cfg: RunConfig, tokenizer: TokenizerInfo) -> None:
    """Raise ConfigError (or DataError) for a run this device or these files cannot train."""
    check_device(cfg, "cuda" if torch.cuda.is_available() else "cpu")
    dp = data_parallel_size(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    resolve_batch_sizes(cfg.train, dp)  # the world fits
    check_data(cfg, tokenizer, dp)
    check_tensorboard(cfg)


def check_device(cfg: RunConfig, device: str) -> None:
    """Precision and attention backend against what ``device`` ("cuda" or "cpu") can train with."""
    backend = cfg.model.attention_backend
    refusal = gpu_cores.refusal(
        backend,
        device,
        dropout=cfg.model.attention_dropout,
        alibi=cfg.model.position == "alibi",
        dtype=precision_dtype(cfg.precision),
    )
    if refusal is not None:
        raise ConfigError(refusal)
    if backend == "varlen" and device == "cpu":
        raise ConfigError("model.attention_backend=varlen needs a CUDA GPU, this machine has none; use auto")
    if cfg.precision == "fp16" and device == "cpu":
        raise ConfigError("precision=fp16 needs a GPU; use precision=bf16 or fp32 on CPU")
    if backend == "flex" and device == "cpu":
        raise ConfigError(
            "model.attention_backend=flex cannot train on CPU (FlexAttention has no CPU backward "
            "pass in this PyTorch); use model.attention_backend=auto or chunked"
        )
    if backend == "flash":
        if device == "cpu":
            raise ConfigError(
                "model.attention_backend=flash needs a CUDA GPU, this machine has none; "
                "use model.attention_backend=auto"
            )
        if flash_attn_module() is None:  # installed is not enough: a build for another torch or CUDA fails on import
            raise ConfigError(
                "model.attention_backend=flash needs the flash-attn package, which does not import "
                f"here; {FLASH_ATTN_INSTALL} or use model.attention_backend=auto"
            )


def check_data(cfg: RunConfig, tokenizer: TokenizerInfo, dp_size: int = 1) -> None:
    """Shards, tokenizer and model agree (the manifests' tokenizer hash and vocabulary, model.vocab_size),
    the objective can use the shards, and the train split feeds data.streams on ``dp_size`` data-parallel ranks
    (before DeepSpeed starts, and builds its ops: minutes); the loaders check the shard files when built."""
    check_shards(loader_settings(cfg), tokenizer, dp_size)
