"""The run config's side of the data: ``data_pipeline`` takes LoaderSettings, this builds them from a RunConfig
(its data section is data_pipeline's DataSettings, passed as is). Nothing in data_pipeline imports the run config."""

from __future__ import annotations

from data_pipeline.loader import LoaderSettings, StreamingLoader, build_loader
from data_pipeline.tokenizer import TokenizerInfo
from megatransformer.config import RunConfig


def loader_settings(cfg: RunConfig, pin_memory: bool = False) -> LoaderSettings:
    """The loader's arguments from a run config (data, objective, objective_args, model.arch/vocab_size, seed);
    ``pin_memory`` for a run on CUDA."""
    return LoaderSettings(
        data=cfg.data,
        objective=cfg.objective,
        arch=cfg.model.arch,
        vocab_size=cfg.model.vocab_size,
        seed=cfg.seed,
        objective_args=cfg.objective_args,
        pin_memory=pin_memory,
    )


def build_run_loader(
    cfg: RunConfig,
    split: str,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    tokenizer: TokenizerInfo,
    epochs: int | None = None,
    pin_memory: bool = False,
) -> StreamingLoader:
    """data_pipeline.loader.build_loader for a run config (same arguments otherwise)."""
    return build_loader(loader_settings(cfg, pin_memory), split, micro_batch_size, dp_rank, dp_size, tokenizer, epochs)


def small_validation_warning(loader: StreamingLoader, micro_batch_size: int) -> str | None:
    """Reads the validation split's first batch (an empty split fails here, before training); a warning when
    the whole split is smaller than one batch."""
    rows = len(next(iter(loader))["input_ids"])
    if rows >= micro_batch_size:
        return None
    return (
        f"warning: the validation split holds {rows} sequence{'s' * (rows != 1)}, less than one batch of "
        f"{micro_batch_size}: validation loss is measured on {'them' if rows > 1 else 'it'} alone (noisy); "
        "shard more validation documents (data shard --valid-every) for a steadier number"
    )
