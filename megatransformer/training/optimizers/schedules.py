"""Optimizer parameter groups and learning-rate schedules."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from megatransformer.config import ConfigError, RunConfig


def param_groups(model: nn.Module, weight_decay: float, decay_everything: bool) -> list[dict]:
    """Weight decay on the matrices of linear layers only, unless told otherwise: norms, biases, token
    embeddings (also when tied to the output head) and learned position tables are not decayed."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        is_matrix = id(param) in linear and id(param) not in embeddings
        (decay if decay_everything or is_matrix else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]  # (ZeRO rejects empty groups)


def lr_multiplier(cfg: RunConfig) -> Callable[[int], float]:
    """Factor applied to optim.lr at optimizer step ``step`` (0-based; the first update uses step 0)."""
    s, total = cfg.schedule, cfg.train.max_steps
    warmup, floor = s.warmup_steps, s.min_lr_ratio

    def factor(step: int) -> float:
        step += 1
        if s.name == "inverse_sqrt":  # Vaswani et al.: d^-0.5 * min(step^-0.5, step * warmup^-1.5)
            return cfg.model.d_model**-0.5 * min(step**-0.5, step * max(warmup, 1) ** -1.5)
        if step <= warmup:
            return step / max(warmup, 1)
        progress = min((step - warmup) / max(total - warmup, 1), 1.0)
        if s.name == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        if s.name == "linear":
            return floor + (1 - floor) * (1 - progress)
        return 1.0

    def wsd(step: int) -> float:
        step += 1
        if step <= warmup:
            return step / max(warmup, 1)
        decay = wsd_decay_steps(cfg)
        progress = (step - (total - decay)) / max(decay, 1)
        if progress <= 0:
            return 1.0
        progress = min(progress, 1.0)
        shape = {
            "linear": 1 - progress,
            "cosine": 0.5 * (1 + math.cos(math.pi * progress)),
            "1-sqrt": 1 - math.sqrt(progress),
        }[s.decay_shape]
        return floor + (1 - floor) * shape

    return wsd if s.name == "wsd" else factor


def wsd_decay_steps(cfg: RunConfig) -> int:
    """Length of the final decay of a wsd schedule: schedule.decay_steps, else decay_fraction of the run."""
    s = cfg.schedule
    return s.decay_steps if s.decay_steps is not None else round(s.decay_fraction * cfg.train.max_steps)


def branch_decay(cfg: RunConfig, start_step: int) -> RunConfig:
    """``cfg`` with its wsd decay running from ``start_step`` (the step of schedule.decay_from's checkpoint) to
    train.max_steps."""
    total = cfg.train.max_steps
    if start_step >= total:
        raise ConfigError(
            f"schedule.decay_from={cfg.schedule.decay_from} is at step {start_step}, not before "
            f"train.max_steps={total}; set train.max_steps to that step plus the decay's length"
        )
    schedule = cfg.schedule.model_copy(update={"decay_steps": total - start_step})
    return cfg.model_copy(update={"schedule": schedule})


def schedule_phase(cfg: RunConfig, step: int) -> str:
    """The phase of ``cfg``'s schedule after ``step`` updates: warmup (the last update was below the peak on the
    way up), stable (at the peak), or decay (below it on the way down; cosine, linear and inverse_sqrt decay
    from the end of their warm-up on)."""
    s, total = cfg.schedule, cfg.train.max_steps
    if step < s.warmup_steps:
        return "warmup"
    if s.name == "constant":
        return "stable"
    if s.name != "wsd":
        return "decay" if step > max(s.warmup_steps, 1) else "stable"
    return "decay" if step > total - wsd_decay_steps(cfg) else "stable"


def describe_decay(cfg: RunConfig, origin: str, start: int) -> str:
    """The run log's line of a branched decay (``cfg`` as :func:`branch_decay` gave it)."""
    f, end = lr_multiplier(cfg), cfg.train.max_steps
    rates = [("lr", cfg.optim.lr)] + ([("muon_lr", cfg.optim.muon_lr)] if cfg.optim.name == "muon" else [])
    at = lambda step: ", ".join(f"{name} {peak * f(step - 1):.4g}" for name, peak in rates)  # noqa: E731
    return (
        f"decaying from step {start}, {at(start)}, to step {end}, {at(end)}, {cfg.schedule.decay_shape} "
        f"(schedule.decay_from: {origin})"
    )


def schedule_change(saved: RunConfig, now: RunConfig, step: int) -> str | None:
    """One line when a resume at ``step`` trains the next step at other learning rates than the checkpoint's
    schedule would have (``saved``: its config; a changed train.max_steps, optim.lr or schedule): the settings
    that differ and the rates; None when they agree."""
    names = ["lr"] + (["muon_lr"] if now.optim.name == "muon" else [])

    def settings(cfg: RunConfig) -> dict[str, object]:
        values = {"train.max_steps": cfg.train.max_steps, **{f"optim.{n}": getattr(cfg.optim, n) for n in names}}
        values |= {f"schedule.{key}": value for key, value in cfg.schedule.model_dump().items()}
        if cfg.schedule.decay_from is not None:
            del values["schedule.decay_steps"]  # (a branch's follow from its train.max_steps)
        return values

    def rates(cfg: RunConfig) -> list[float]:
        return [getattr(cfg.optim, name) * lr_multiplier(cfg)(step) for name in names]

    then, rate = rates(saved), rates(now)
    if all(math.isclose(a, b, rel_tol=1e-9) for a, b in zip(then, rate)):
        return None
    before, after = settings(saved), settings(now)
    changed = ", ".join(
        f"{key}={value} ({before.get(key)} there)" for key, value in after.items() if value != before.get(key)
    )
    shown = lambda values: ", ".join(f"{name} {value:.4g}" for name, value in zip(names, values))  # noqa: E731
    line = (
        f"resume: the learning-rate schedule differs from the checkpoint's ({changed}): step {step + 1} trains at "
        f"{shown(rate)}, not {shown(then)}"
    )
    if rate[0] > then[0] and schedule_phase(saved, step) == "decay":
        line += "; the checkpoint's rate had decayed and rises again"
        if saved.schedule.name == "wsd":
            line += " (to train on and then decay, branch a decay from a stable checkpoint: schedule.decay_from)"
    return line


def warmup_warning(cfg: RunConfig) -> str | None:
    """One line when the warm-up is longer than the run: the learning rate would never reach optim.lr."""
    warmup, total = cfg.schedule.warmup_steps, cfg.train.max_steps
    if warmup <= total:
        return None
    return (
        f"warning: schedule.warmup_steps={warmup} is longer than the run (train.max_steps={total}): the "
        f"learning rate reaches only {total / warmup:.0%} of its peak; lower schedule.warmup_steps"
    )


def make_scheduler(cfg: RunConfig) -> Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LambdaLR]:
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(cfg))
