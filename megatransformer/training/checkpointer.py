"""DeepSpeed's states in and out of the engine: saving a checkpoint, and loading it on the same layout (exact)
or on another one (elastic). The directory format is ``megatransformer.checkpoint``'s; docs/checkpoints.md."""

from __future__ import annotations

import functools
import importlib
import json
import re
import shutil
from collections.abc import Callable, Collection, Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data_pipeline import WriteFailed, free_space, write_reason
from megatransformer import checkpoint as ckpt
from megatransformer.config import ConfigError, RunConfig, dump_config
from megatransformer.model.tp_plan import partition_dim
from megatransformer.training.distributed import shared_work
from megatransformer.training.rng import rng_state, set_rng_state

ADAM_KEYS = ("exp_avg", "exp_avg_sq")


@functools.cache
def deepspeed_safe_globals() -> list[type]:
    """The classes :data:`ckpt.DEEPSPEED_STATE_GLOBALS` names, which our weights_only loads of DeepSpeed's
    states allow (for the duration of those loads only, not process-wide)."""
    classes = []
    for name in ckpt.DEEPSPEED_STATE_GLOBALS:
        module, _, attribute = name.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attribute))
    return classes


def safe_checkpoint_engine(config: Any):
    """DeepSpeed's torch checkpoint engine (saving unchanged) whose loads are weights_only
    (:func:`ckpt.safe_load`); DeepSpeed reads every model and optimizer state file of a resume through
    ``engine.checkpoint_engine``. (DeepSpeed has no configuration key for an engine of one's own; the
    attribute is where it looks.)"""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return ckpt.safe_load(Path(path), map_location, deepspeed_safe_globals())

    return SafeCheckpointEngine(config)


def innermost_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's ZeRO and bf16 wrappers (each keeps the next in ``.optimizer``):
    the one whose ``step`` changes state."""
    inner = engine.optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


# ------------------------------------------------------------------------------------ saving


def save_checkpoint(
    engine, cfg: RunConfig, state: ckpt.TrainerState, loader_state: dict, keep: Collection[str] = ()
) -> Path:
    """Write step ``state.step``'s checkpoint: DeepSpeed's per-rank states, each rank's loader and RNG state,
    the consolidated weights and Adam state, trainer state, config and tokenizer, and last the manifest and
    `latest`. Older checkpoints beyond ``checkpoint.keep`` are removed, except those named in ``keep``.
    A write that fails on any rank (a full disk) removes the new checkpoint and raises :class:`WriteFailed`
    on every rank; the previous checkpoints are untouched. A collective: every rank calls it."""
    root = ckpt.checkpoints_dir(cfg.run_dir)
    tag = ckpt.step_name(state.step)
    path = root / tag
    rank = dist.get_rank()
    if rank == 0 and path.exists():  # a leftover from a run killed while saving this step
        shutil.rmtree(path)
    dist.barrier()
    engine._copy_recovery_script = _no_recovery_scripts
    writes = Writes()
    writes.attempt("DeepSpeed's states", lambda: engine.save_checkpoint(str(root), tag=tag, save_latest=False))
    writes.attempt(
        ckpt.rank_file(rank),
        lambda: torch.save({"loader": loader_state, "rng": rng_state()}, path / ckpt.rank_file(rank)),
    )
    weights = full_state_dict(engine, cfg)
    moments, optimizer_meta = full_optimizer_state(engine, cfg)
    if rank == 0:
        writes.attempt(ckpt.WEIGHTS, lambda: ckpt.save_safetensors(weights, path / ckpt.WEIGHTS))
        writes.attempt(ckpt.OPTIMIZER, lambda: ckpt.save_safetensors(moments, path / ckpt.OPTIMIZER, optimizer_meta))
        writes.attempt(ckpt.TRAINER_STATE, lambda: ckpt.write_trainer_state(path, state))
        writes.attempt(ckpt.CONFIG, lambda: (path / ckpt.CONFIG).write_text(dump_config(cfg)))
        if cfg.data.tokenizer:
            writes.attempt(ckpt.TOKENIZER, lambda: shutil.copyfile(cfg.data.tokenizer, path / ckpt.TOKENIZER))
    writes.agree(path)  # (in place of a barrier)
    names = [ckpt.checkpoint_files(path) if rank == 0 else None]  # one listing, so every rank hashes its share
    dist.broadcast_object_list(names, src=0)
    entries = shared_work(names[0], lambda name: ckpt.file_entry(path / name))
    if rank == 0:
        writes.attempt(ckpt.COMPLETE, lambda: ckpt.write_manifest(path, entries))
        writes.attempt(ckpt.LATEST, lambda: ckpt.atomic_write(root / ckpt.LATEST, tag))
    writes.agree(path)
    if rank == 0:
        ckpt.prune(root, cfg.checkpoint.keep, keep={tag, *keep})
    dist.barrier()
    return path


# torch.save reports a failed write as a RuntimeError of its zip writer, without the OS's reason
_TORCH_WRITE_FAILED = re.compile(r"PytorchStreamWriter failed|file write failed|unexpected pos", re.IGNORECASE)


class Writes:
    """The writes of one rank during a save: the first one that fails (a full disk, a quota, an I/O error) is
    remembered and the rank's later writes are left out, while it still takes part in every collective;
    :meth:`agree` then tells every rank whether any failed."""

    def __init__(self) -> None:
        self.failed: tuple[str, str] | None = None  # (the file, the reason)

    def attempt(self, name: str, write: Callable[[], object]) -> None:
        from safetensors import SafetensorError

        if self.failed is not None:
            return
        try:
            write()
        except (OSError, SafetensorError) as err:
            self.failed = (name, write_reason(err))
        except RuntimeError as err:
            if not _TORCH_WRITE_FAILED.search(str(err)):
                raise
            self.failed = (name, "the file could not be written (torch.save)")

    def agree(self, path: Path) -> None:
        """A collective: on every rank, if any rank's write failed, remove checkpoint ``path`` (rank 0) and raise
        :class:`WriteFailed` naming the file, the free space and the last intact checkpoint."""
        failures: list[tuple[str, str] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(failures, self.failed)
        failed = next(((rank, f) for rank, f in enumerate(failures) if f is not None), None)
        if failed is None:
            return
        rank, (name, reason) = failed
        if dist.get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)  # (nothing half-written stays; `latest` still names the last)
        dist.barrier()
        last = ckpt.latest_checkpoint(path.parent)
        intact = (
            f"the last intact checkpoint is {last.name} (resume=auto continues from it)"
            if last is not None
            else "no checkpoint of this run is complete yet"
        )
        where = f" on rank {rank}" if len(failures) > 1 else ""
        raise WriteFailed(
            f"writing checkpoint {path.name} failed{where} ({name}): {reason} ({free_space(path.parent)}); {intact}"
        )


def _no_recovery_scripts(save_path: str) -> None:
    """In place of DeepSpeed's copy of its zero_to_fp32.py / zero_to_torch.py into every ZeRO checkpoint: the
    whole model is model.safetensors already (``megatransformer export`` writes it out), and a checkpoint
    holds no code."""


def full_state_dict(engine, cfg: RunConfig) -> dict[str, torch.Tensor] | None:
    """fp32 weights of the whole model on rank 0, one tensor at a time (a model larger than a device's memory
    is never whole on a device): the optimizer's fp32 master copy where there is one (bf16/fp16 training,
    ZeRO partitions gathered), tensor-parallel shards concatenated. A collective: every rank calls it."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters = functools.cache(lambda: fp16_optimizer_masters(engine.optimizer))

    def fp32(tensor: torch.Tensor) -> torch.Tensor:
        full = safe_get_full_fp32_param(tensor) if isinstance(tensor, torch.nn.Parameter) else None
        return masters().get(id(tensor), tensor) if full is None else full

    return consolidate(cfg, fp32, engine.module.state_dict(keep_vars=True).items())


def full_optimizer_state(engine, cfg: RunConfig) -> tuple[dict[str, torch.Tensor] | None, dict[str, str]]:
    """The whole Adam state on rank 0 (None elsewhere) as ``{KEY/NAME: fp32 tensor}``, and the metadata to
    store with it (the optimizer's step count, the LR scheduler's state as JSON). A collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    inner = innermost_optimizer(engine)
    stepped = any(inner.state.values())  # Adam's state appears with its first step (every rank alike)
    if stepped:
        _link_state(engine)
    named = list(engine.module.named_parameters())  # (a tied weight once, under its first name)
    tensors: dict[str, torch.Tensor] = {}
    for key in ADAM_KEYS:
        masters = functools.cache(lambda key=key: fp16_optimizer_masters(engine.optimizer, key))

        def moment(param: torch.Tensor, key: str = key, masters=masters) -> torch.Tensor:
            if not stepped:  # (every update so far was skipped: zero moments, as Adam starts)
                return torch.zeros(getattr(param, "ds_shape", param.shape), dtype=torch.float32, device=param.device)
            full = safe_get_full_optimizer_state(param, key)  # ZeRO 1-3, bf16 optimizer (a collective)
            if full is None:
                full = masters().get(id(param))  # ZeRO-0 with bf16/fp16 masters
            if full is None:
                full = inner.state.get(param, {}).get(key)  # ZeRO-0 fp32: the torch optimizer's own
            return torch.zeros_like(param, dtype=torch.float32) if full is None else full  # (no step yet)

        part = consolidate(cfg, moment, named)
        if part is not None:
            tensors.update({f"{key}/{name}": value for name, value in part.items()})
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    meta = {"adam_step": str(_adam_step(inner)), "lr_scheduler": json.dumps(scheduler)}
    return (tensors if dist.get_rank() == 0 else None), meta


def consolidate(
    cfg: RunConfig, value: Callable[[torch.Tensor], torch.Tensor], named: Iterable[tuple[str, torch.Tensor]]
) -> dict[str, torch.Tensor] | None:
    """``value`` of every (name, tensor) of ``named`` as one whole fp32 tensor on rank 0 (None elsewhere), one
    at a time: ``value`` gives this rank's tensor-parallel shard (gathering ZeRO partitions itself), the shards
    are concatenated along TP_PLAN's dimension here. A tensor under two names (tied weights) is gathered once
    and stored under both (safetensors stores no two names for one storage). A collective."""
    is_main, tp = dist.get_rank() == 0, cfg.parallel.tensor_parallel
    state: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor | None] = {}
    for name, tensor in named:
        tied = id(tensor) in done
        if not tied:
            full = value(tensor).detach().float()
            dim = partition_dim(name) if tp > 1 else None
            if dim is not None:
                full = _gather_shards(full, dim, tp)
            done[id(tensor)] = full.cpu().clone() if is_main else None
        if is_main:
            state[name] = done[id(tensor)].clone() if tied else done[id(tensor)]
    return state if is_main else None


def fp16_optimizer_masters(optimizer, key: str | None = None) -> dict[int, torch.Tensor]:
    """bf16/fp16 without ZeRO: DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer keep fp32 masters (one
    flat tensor, or one tensor per parameter, per group) that ``safe_get_full_fp32_param`` does not know
    about; map each low-precision parameter to its master, or with ``key`` to the master's optimizer state
    ``key`` (views: writing them writes the state; masters without that state yet are left out)."""
    from torch._utils import _unflatten_dense_tensors

    low = getattr(optimizer, "fp16_groups", None)
    if low is None:
        return {}

    def state_of(master: torch.Tensor) -> torch.Tensor | None:
        return master if key is None else optimizer.optimizer.state.get(master, {}).get(key)

    if hasattr(optimizer, "fp32_groups_flat"):
        flats = [state_of(f) for f in optimizer.fp32_groups_flat]
        high = [
            [None] * len(params) if f is None else _unflatten_dense_tensors(f, params) for f, params in zip(flats, low)
        ]
    else:
        high = [[state_of(m) for m in masters] for masters in getattr(optimizer, "fp32_groups", [])]
    return {
        id(p): master for params, masters in zip(low, high) for p, master in zip(params, masters) if master is not None
    }


def _gather_shards(shard: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    from deepspeed.utils import groups

    pieces = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(pieces, shard.contiguous(), group=groups.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=dim)


def _link_state(engine) -> None:
    """ZeRO 1/2 and DeepSpeed's bf16 optimizer map each parameter to its piece of the optimizer state (what
    ``safe_get/set_full_optimizer_state`` read and write) once, after the first optimizer step; DeepSpeed
    0.19 steps the parameter groups one at a time and maps after the first group's step, so the other
    groups' parameters are never mapped. Map them all again (the state exists for every group here)."""
    link = getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        engine.optimizer._hp_optimizer_states_linked = False
        link()


def _adam_step(inner: torch.optim.Optimizer) -> int:
    return int(max((float(s["step"]) for s in inner.state.values() if "step" in s), default=0))


# ------------------------------------------------------------------------------------ loading


def load_exact(engine, path: Path) -> dict:
    """DeepSpeed's own states of ``path`` (written on this very layout) and this rank's RNG; returns this
    rank's data-loader state. Every state file is read with weights_only=True."""
    own = ckpt.safe_load(path / ckpt.rank_file(dist.get_rank()), allowed=deepspeed_safe_globals())
    engine.checkpoint_engine = safe_checkpoint_engine(engine._config)  # (its parsed DeepSpeed config)
    loaded, _ = engine.load_checkpoint(
        str(path.parent), tag=path.name, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if loaded is None:
        raise ConfigError(f"DeepSpeed could not load checkpoint {path}")
    apply_schedule(engine.lr_scheduler)
    set_rng_state(own["rng"])
    return own["loader"]


def load_elastic(
    engine, cfg: RunConfig, path: Path, saved_world_size: int, weights: dict[str, torch.Tensor], tp_rank: int
) -> list[dict]:
    """Complete a resume on another layout on an engine built from ``weights`` (the whole model's fp32
    masters): this rank's share of the masters, the Adam moments and step count, the LR schedule, and rank 0's
    RNG (every rank draws the same numbers); returns the loader states of all old ranks (the loader merges
    them into the global row position)."""
    old_ranks = [
        ckpt.safe_load(path / ckpt.rank_file(r), allowed=deepspeed_safe_globals()) for r in range(saved_world_size)
    ]
    moments, meta = ckpt.load_safetensors(path, ckpt.OPTIMIZER)
    tp = cfg.parallel.tensor_parallel

    def mine(name: str, full: torch.Tensor) -> torch.Tensor:  # this rank's tensor-parallel shard
        dim = partition_dim(name) if tp > 1 else None
        return full if dim is None else full.chunk(tp, dim)[tp_rank]

    inner = innermost_optimizer(engine)
    _ensure_adam_state(engine, inner, int(meta["adam_step"]))
    _link_state(engine)
    _set_full(engine, inner, None, {name: mine(name, w) for name, w in weights.items()})
    for key in ADAM_KEYS:
        prefix = f"{key}/"
        _set_full(
            engine,
            inner,
            key,
            {
                name[len(prefix) :]: mine(name[len(prefix) :], v)
                for name, v in moments.items()
                if name.startswith(prefix)
            },
        )
    scheduler = json.loads(meta["lr_scheduler"])
    if engine.lr_scheduler is not None and scheduler is not None:
        engine.lr_scheduler.load_state_dict(scheduler)
        apply_schedule(engine.lr_scheduler)
    set_rng_state(old_ranks[0]["rng"])
    return [r["loader"] for r in old_ranks]


def apply_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR | None) -> None:
    """The learning rate of the next step from this run's schedule (a resume that changes train.max_steps
    changes it), not the one the saved run computed with its own: a scheduler's load restores its step count and
    last rates, never the optimizer's, and the rate function is never saved."""
    if scheduler is None:
        return
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = lr
    scheduler._last_lr = rates  # (what get_last_lr() answers; torch keeps it in this field)


def _ensure_adam_state(engine, inner: torch.optim.Optimizer, step: int) -> None:
    """Every tensor the torch optimizer steps has Adam state (it makes it lazily at the first step), with
    the saved step count."""
    for p, group in _stepped(engine, inner):
        state = inner.state[p]
        for key in ADAM_KEYS:
            state.setdefault(key, torch.zeros_like(p, memory_format=torch.preserve_format))
        old = state.get("step")
        if isinstance(old, torch.Tensor):
            state["step"] = torch.full_like(old, float(step))
        elif old is not None:
            state["step"] = type(old)(step)
        else:
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device if on_device else "cpu")


def _stepped(engine, inner: torch.optim.Optimizer) -> list[tuple[torch.Tensor, dict]]:
    """The tensors the torch optimizer updates, with their parameter group. ZeRO-3 puts its flat fp32
    partitions into the groups only for the duration of a step."""
    flats = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)
    if flats is not None:
        group_of = engine.optimizer.sub_group_to_group_id
        return [(flat, inner.param_groups[group_of[i]]) for i, flat in enumerate(flats)]
    return [(p, group) for group in inner.param_groups for p in group["params"]]


@torch.no_grad()
def _set_full(engine, inner: torch.optim.Optimizer, key: str | None, values: dict[str, torch.Tensor]) -> None:
    """Write this rank's tensor-parallel share ``values[name]`` of each parameter's fp32 master (``key``
    None) or optimizer state ``key`` into the engine, wherever its layout keeps it."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    masters = fp16_optimizer_masters(engine.optimizer, key)
    for name, param in engine.module.named_parameters():
        value = values[name]
        if hasattr(param, "ds_id") or hasattr(param, "_hp_mapping"):  # ZeRO 1-3, bf16 optimizer
            value = value.to(torch.float32)
            if key is None:
                safe_set_full_fp32_param(param, value)
            else:
                safe_set_full_optimizer_state(param, value, key)
        elif id(param) in masters:  # ZeRO-0 with bf16/fp16 masters
            masters[id(param)].copy_(value.view_as(masters[id(param)]))
        elif key is not None:  # ZeRO-0 fp32: the torch optimizer's own state (the weights came with the model)
            inner.state[param][key].copy_(value.view_as(param))
