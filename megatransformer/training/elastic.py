"""Elastic resume: continue a run on another data-parallel size, tensor-parallel size or ZeRO stage.

A checkpoint holds, besides DeepSpeed's per-rank states (exact resume on the same layout), the whole model's
fp32 masters (model.safetensors) and the whole Adam state (optimizer.safetensors: ``exp_avg/NAME`` and
``exp_avg_sq/NAME`` in fp32, ZeRO partitions and tensor-parallel shards gathered one tensor at a time; the
optimizer's step count and the learning-rate scheduler's state in its metadata). Neither depends on the
layout, so a resume on another one builds the engine for the new layout from the saved weights and then
puts this rank's share of the masters and moments into it (deepspeed.utils ``safe_set_full_*`` for ZeRO 1-3
and DeepSpeed's bf16 optimizer; the FP16_Optimizer masters and the torch optimizer's own state for ZeRO-0).
The loader continues the global row sequence from the states of all old ranks, the RNG from rank 0's
(every rank draws the same numbers), the schedule from the saved scheduler state.

Why not DeepSpeed's universal checkpoint: ``ds_to_universal`` is an offline conversion of ZeRO optimizer
shards (``*_optim_states.pt`` of ZeRO 1-3); a ZeRO-0 fp32 run writes none (its Adam state lives in the
torch optimizer inside the model states file), and its reader expects the conversion's folder layout, so it
would add a conversion step and still leave ZeRO-0 out. The consolidated files need no conversion, are read
with safetensors (no pickle), and are the same files for every stage.

The global batch must stay the same for the continuation to be exact (train.global_batch_size, with micro
batch and accumulation re-derived for the new data-parallel size); another global batch is refused unless
``resume_elastic=allow_batch_change``, which continues the same global row sequence, step count and
schedule with the new batch (the nearest consistent point: no row is skipped or repeated).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from megatransformer.config import ConfigError, RunConfig
from megatransformer.model.tp_plan import partition_dim
from megatransformer.training import checkpoint as ckpt
from megatransformer.training.rng import set_rng_state
from megatransformer.training.batching import BatchSizes, resolve_batch_sizes
from megatransformer.training.engine import engine_zero_stage

OPTIMIZER = "optimizer.safetensors"
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


# ------------------------------------------------------------------------------------ saving


def full_optimizer_state(engine, cfg: RunConfig) -> tuple[dict[str, torch.Tensor] | None, dict[str, str]]:
    """The whole Adam state on rank 0 (None elsewhere) as ``{KEY/NAME: fp32 tensor}``, and the metadata to
    store with it (the optimizer's step count, the LR scheduler's state as JSON). A collective."""
    from deepspeed.utils import safe_get_full_optimizer_state

    inner = _torch_optimizer(engine)
    stepped = any(inner.state.values())  # Adam's state appears with its first step (every rank alike)
    if stepped:
        _link_state(engine)
    named = list(engine.module.named_parameters())  # (a tied weight once, under its first name)
    tensors: dict[str, torch.Tensor] = {}
    for key in ADAM_KEYS:
        masters = functools.cache(lambda key=key: ckpt.fp16_optimizer_masters(engine.optimizer, key))

        def moment(param: torch.Tensor, key: str = key, masters=masters) -> torch.Tensor:
            if not stepped:  # (every update so far was skipped: zero moments, as Adam starts)
                return torch.zeros(getattr(param, "ds_shape", param.shape), dtype=torch.float32, device=param.device)
            full = safe_get_full_optimizer_state(param, key)  # ZeRO 1-3, bf16 optimizer (a collective)
            if full is None:
                full = masters().get(id(param))  # ZeRO-0 with bf16/fp16 masters
            if full is None:
                full = inner.state.get(param, {}).get(key)  # ZeRO-0 fp32: the torch optimizer's own
            return torch.zeros_like(param, dtype=torch.float32) if full is None else full  # (no step yet)

        part = ckpt.consolidate(engine, cfg, moment, named)
        if part is not None:
            tensors.update({f"{key}/{name}": value for name, value in part.items()})
    scheduler = engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None
    meta = {"adam_step": str(_adam_step(inner)), "lr_scheduler": json.dumps(scheduler)}
    return (tensors if dist.get_rank() == 0 else None), meta


def _torch_optimizer(engine) -> torch.optim.Optimizer:
    """The innermost optimizer (DeepSpeed's ZeRO and bf16 wrappers keep it in ``.optimizer``)."""
    inner = engine.optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


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


# ----------------------------------------------------------------------------------- planning


@dataclass
class ElasticResume:
    """What a resume on another layout loads, decided before the engine is built."""

    path: Path
    saved: ckpt.TrainerState
    saved_sizes: BatchSizes
    sizes: BatchSizes
    weights: dict[str, torch.Tensor]  # the whole model's fp32 masters (the engine is built from them)
    zero_stage: int  # the stage the new engine runs (engine.engine_zero_stage)

    def describe(self, cfg: RunConfig, world_size: int) -> str:
        s, old, new = self.saved, self.saved_sizes, self.sizes
        was = _layout(old.dp, s.tensor_parallel, s.zero_stage)
        now = _layout(new.dp, cfg.parallel.tensor_parallel, self.zero_stage)
        line = (f"resuming step {s.step} written by {_ranks(s.world_size)} ({was}) on {_ranks(world_size)} ({now}): "
                f"micro {new.micro} x accum {new.accum} (was micro {old.micro} x accum {old.accum})")
        if new.global_batch != old.global_batch:
            line += (f"; global batch {old.global_batch} -> {new.global_batch} (resume_elastic=allow_batch_change): "
                     "not an exact continuation")
        return line


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


def _layout(dp: int, tp: int, zero: int) -> str:
    return f"dp{dp}, tp{tp}, zero{zero}"


def plan_resume(cfg: RunConfig, path: Path | None, world_size: int, device_type: str) -> ElasticResume | None:
    """For a resume from ``path``: refuse a changed global batch (unless allowed), and on another layout
    (world size, tensor_parallel or zero_stage than the checkpoint's) return what to load; None on the same
    layout (DeepSpeed's exact resume) or without a checkpoint. Before any engine is built."""
    if path is None:
        return None
    saved = ckpt.read_trainer_state(path)
    saved_cfg = ckpt.saved_config(path)
    tp = cfg.parallel.tensor_parallel
    saved_sizes = resolve_batch_sizes(saved_cfg.train, saved.world_size // saved.tensor_parallel)
    sizes = resolve_batch_sizes(cfg.train, world_size // tp)
    if sizes.global_batch != saved_sizes.global_batch and cfg.resume_elastic != "allow_batch_change":
        raise ConfigError(
            f"checkpoint {path} was trained with global batch {saved_sizes.global_batch} (micro "
            f"{saved_sizes.micro} x accum {saved_sizes.accum} x dp {saved_sizes.dp}), this run's is "
            f"{sizes.global_batch} (micro {sizes.micro} x accum {sizes.accum} x dp {sizes.dp}); set "
            f"train.global_batch_size={saved_sizes.global_batch} to continue exactly, or "
            "resume_elastic=allow_batch_change to continue with the new batch")
    zero_stage = engine_zero_stage(cfg, sizes.dp, device_type)
    if (saved.world_size, saved.tensor_parallel, saved.zero_stage) == (world_size, tp, zero_stage):
        return None
    if not (path / OPTIMIZER).is_file():
        raise ConfigError(
            f"checkpoint {path} has no {OPTIMIZER} (written before elastic resume existed), so it resumes only "
            f"on its own layout: world size {saved.world_size}, parallel.tensor_parallel={saved.tensor_parallel}, "
            f"parallel.zero_stage={saved.zero_stage} (or start a new run from its weights with init_from=)")
    ckpt.check_same_shapes(saved_cfg.model, cfg.model, f"checkpoint {path}")
    return ElasticResume(path, saved, saved_sizes, sizes, _load_safetensors(path, ckpt.WEIGHTS)[0], zero_stage)


def _load_safetensors(path: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path / name), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise ckpt.CheckpointDamaged(path, name, f"unreadable ({str(err)[:200]})") from None


# ------------------------------------------------------------------------------------ loading


def load_elastic(engine, cfg: RunConfig, plan: ElasticResume, tokenizer_sha256: str | None,
                 tp_rank: int) -> tuple[ckpt.TrainerState, list[dict]]:
    """Complete a resume on another layout on an engine built from ``plan.weights``: the fp32 masters,
    Adam moments and step count, the LR schedule and RNG; returns the trainer state (now of this layout)
    and the loader states of all old ranks (the loader merges them)."""
    path, saved = plan.path, plan.saved
    ckpt.check_tokenizer(path, saved, cfg, tokenizer_sha256)
    old_ranks = [ckpt.safe_load(path / f"rank_{r:05d}.pt") for r in range(saved.world_size)]
    moments, meta = _load_safetensors(path, OPTIMIZER)
    tp = cfg.parallel.tensor_parallel

    def mine(name: str, full: torch.Tensor) -> torch.Tensor:  # this rank's tensor-parallel shard
        dim = partition_dim(name) if tp > 1 else None
        return full if dim is None else full.chunk(tp, dim)[tp_rank]

    inner = _torch_optimizer(engine)
    step = int(meta["adam_step"])
    _ensure_adam_state(engine, inner, step)
    _link_state(engine)
    _set_full(engine, inner, None, {name: mine(name, w) for name, w in plan.weights.items()})
    for key in ADAM_KEYS:
        prefix = f"{key}/"
        _set_full(engine, inner, key, {name[len(prefix):]: mine(name[len(prefix):], v)
                                       for name, v in moments.items() if name.startswith(prefix)})
    scheduler = json.loads(meta["lr_scheduler"])
    if engine.lr_scheduler is not None and scheduler is not None:
        engine.lr_scheduler.load_state_dict(scheduler)
        for group, lr in zip(engine.lr_scheduler.optimizer.param_groups, engine.lr_scheduler.get_last_lr()):
            group["lr"] = lr  # (a scheduler's load sets its own fields, not the optimizer's)
    set_rng_state(old_ranks[0]["rng"])
    state = ckpt.TrainerState(**{**saved.__dict__, "world_size": dist.get_world_size(), "tensor_parallel": tp,
                                 "zero_stage": engine.zero_optimization_stage()})
    return state, [r["loader"] for r in old_ranks]


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

    masters = ckpt.fp16_optimizer_masters(engine.optimizer, key)
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
