"""A run's layout from one place: batch arithmetic (global batch = micro batch x grad-accum x data-parallel
size) and the ZeRO stage the engine runs."""

from __future__ import annotations

from dataclasses import dataclass

from megatransformer.config import ConfigError, RunConfig, TrainConfig


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
        _check(
            rest == 0 and micro > 0,
            f"train.global_batch_size={total} is not divisible by train.grad_accum={accum} x data-parallel size {dp}",
        )
    elif accum is None:
        accum, rest = divmod(total, micro * dp)
        _check(
            rest == 0 and accum > 0,
            f"train.global_batch_size={total} is not divisible by "
            f"train.micro_batch_size={micro} x data-parallel size {dp}",
        )
    sizes = BatchSizes(micro, accum, dp)
    _check(
        total is None or sizes.global_batch == total,
        f"train.global_batch_size={total} != micro_batch_size={micro} x grad_accum={accum} x "
        f"data-parallel size {dp} = {sizes.global_batch}",
    )
    return sizes


def exact_batch_overrides(train: TrainConfig, global_batch: int, dp: int) -> list[str] | None:
    """The ``train.*`` overrides that give ``global_batch`` on ``dp`` data-parallel ranks: the micro batch kept
    where it divides the rows of a rank (else the largest below it that does), every field that then differs
    from ``train``'s; None when ``dp`` does not divide ``global_batch``."""
    if global_batch % dp:
        return None
    rows = global_batch // dp
    micro = max(m for m in range(1, min(train.micro_batch_size or rows, rows) + 1) if rows % m == 0)
    values = {"micro_batch_size": micro, "grad_accum": rows // micro, "global_batch_size": global_batch}
    return [f"train.{name}={value}" for name, value in values.items() if getattr(train, name) != value]


def keep_global_batch(train: TrainConfig, global_batch: int, dp: int) -> BatchSizes | None:
    """The layout of ``global_batch`` on ``dp`` data-parallel ranks for a resume that keeps it: ``train``'s own
    where it gives that batch, else the micro batch kept where it divides the rows of a rank (else the largest
    below it that does) and the accumulation derived; None when ``dp`` does not divide ``global_batch``."""
    try:
        sizes = resolve_batch_sizes(train, dp)
        if sizes.global_batch == global_batch:
            return sizes
    except ConfigError:
        pass
    if global_batch % dp:
        return None
    rows = global_batch // dp
    micro = max(m for m in range(1, min(train.micro_batch_size or rows, rows) + 1) if rows % m == 0)
    return BatchSizes(micro, rows // micro, dp)


def validation_rows(train: TrainConfig) -> int:
    """Rows of the validation split each validation pass reads, whatever the layout: ``train.eval_rows``, else
    ``train.eval_batches`` micro batches of one data-parallel rank's micro batch (``train.micro_batch_size``, or
    global batch / grad_accum where the micro batch is derived)."""
    if train.eval_rows is not None:
        return train.eval_rows
    micro = train.micro_batch_size
    if micro is None:
        total, accum = train.global_batch_size, train.grad_accum
        micro = max(1, (total or 1) // (accum or 1))
    return train.eval_batches * micro


def validation_batch(rows: int, micro: int) -> int:
    """The batch the validation split is read in: the largest that divides ``rows`` and is at most ``micro``
    (so that a pass reads exactly ``rows`` rows)."""
    return max(m for m in range(1, min(micro, rows) + 1) if rows % m == 0)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def data_parallel_size(cfg: RunConfig, world_size: int) -> int:
    """Ranks that read distinct batches: the world over the tensor- and sequence-parallel degrees."""
    p = cfg.parallel
    group = p.tensor_parallel * p.sequence_parallel
    _check(
        world_size % group == 0,
        f"parallel.tensor_parallel={p.tensor_parallel} x parallel.sequence_parallel="
        f"{p.sequence_parallel} does not divide the world size {world_size}",
    )
    return world_size // group


def describe_layout(dp: int, tp: int, sp: int) -> str:
    """The layout as the run log says it: ``dp2 x sp2`` (degrees of 1 left out, but dp)."""
    return " x ".join([f"dp{dp}"] + [f"{name}{n}" for name, n in (("tp", tp), ("sp", sp)) if n > 1])


def engine_zero_stage(cfg: RunConfig, dp_size: int, device_type: str) -> int:
    """The ZeRO stage the engine runs: ``parallel.zero_stage``, except that stage 1 or 2 over a single
    data-parallel rank (and no sequence parallelism: ZeRO partitions over the ranks of a sequence group too)
    runs as stage 0 in fp32, and in fp16 on a CPU.

    Partitioning optimizer states or gradients over one rank saves no memory (its one partition is all of
    them), yet DeepSpeed's ZeRO-1/2 path still copies every gradient through its reduction buckets into flat
    partitions: 6-17% of a step at dp=1 on CPU (BENCHMARKS.md section 5c). torchtitan likewise applies FSDP
    only when there is more than one shard. ZeRO-0 steps the same AdamW on the same fp32 masters. Not in bf16
    or fp16 on a GPU: there DeepSpeed's ZeRO-0 wrapper (FP16_UnfusedOptimizer) reads every parameter's
    overflow flag and norm on the host, a wait for the GPU per parameter, where ZeRO's own step waits a
    constant few times (bench/gpu_check.py); on a CPU such a read costs nothing. Offloading needs a ZeRO stage
    and keeps it; ZeRO-3 is left as asked. Checkpoints record the stage that ran, so a resume on another
    data-parallel size, stage or device goes through elastic resume. Never in bf16: only DeepSpeed's ZeRO
    optimizers accumulate bf16 gradients in fp32 (:func:`deepspeed_config`).
    """
    p = cfg.parallel
    free_reads = cfg.precision == "fp32" or (device_type == "cpu" and cfg.precision == "fp16")
    if p.zero_stage in (1, 2) and dp_size * p.sequence_parallel == 1 and free_reads and not p.offload_optimizer:
        return 0
    return p.zero_stage


def zero_stage_notes(cfg: RunConfig, engine_stage: int, device_type: str) -> list[str]:
    """The run log's lines about the ZeRO stage the engine runs (``engine_stage``)."""
    notes = []
    if engine_stage != cfg.parallel.zero_stage:
        notes.append(
            f"parallel.zero_stage={cfg.parallel.zero_stage} on one data-parallel rank: nothing to partition, "
            "so DeepSpeed runs without ZeRO (the same AdamW, without the bucket copies)"
        )
    if engine_stage == 0 and cfg.precision == "bf16" and cfg.train.grad_accum != 1:
        notes.append(
            "precision=bf16 with parallel.zero_stage=0 accumulates gradients over micro batches in bf16 "
            "(DeepSpeed accumulates in fp32 from ZeRO-1 on)"
        )
    if engine_stage == 0 and cfg.precision != "fp32" and device_type == "cuda":
        notes.append(
            f"warning: precision={cfg.precision} with parallel.zero_stage=0 steps through DeepSpeed's unfused "
            f"{cfg.precision} optimizer, which waits for the GPU once per parameter in every step; "
            "parallel.zero_stage=1 waits a constant few times"
        )
    return notes
