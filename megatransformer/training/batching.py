"""Batch arithmetic from one place: global batch = micro batch x grad-accum x data-parallel size."""

from __future__ import annotations

from dataclasses import dataclass

from megatransformer.config import ConfigError, TrainConfig


@dataclass(frozen=True)
class BatchSizes:
    micro: int
    accum: int
    dp: int

    @property
    def global_batch(self) -> int:
        return self.micro * self.accum * self.dp


def resolve_batch_sizes(train: TrainConfig, dp: int) -> BatchSizes:
    """Any two of micro_batch_size, grad_accum, global_batch_size given, the third is derived."""
    micro, accum, total = train.micro_batch_size, train.grad_accum, train.global_batch_size
    given = sum(v is not None for v in (micro, accum, total))
    if given < 2 and micro is None:
        raise ConfigError("set two of train.micro_batch_size, train.grad_accum, train.global_batch_size")
    if given < 2:
        accum = 1 if total is None else None
    if micro is None:
        micro, rest = divmod(total, accum * dp)
        _check(rest == 0 and micro > 0, f"train.global_batch_size={total} is not divisible by "
                                        f"train.grad_accum={accum} x data-parallel size {dp}")
    elif accum is None:
        accum, rest = divmod(total, micro * dp)
        _check(rest == 0 and accum > 0, f"train.global_batch_size={total} is not divisible by "
                                        f"train.micro_batch_size={micro} x data-parallel size {dp}")
    sizes = BatchSizes(micro, accum, dp)
    _check(total is None or sizes.global_batch == total,
           f"train.global_batch_size={total} != micro_batch_size={micro} x grad_accum={accum} x "
           f"data-parallel size {dp} = {sizes.global_batch}")
    return sizes


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
