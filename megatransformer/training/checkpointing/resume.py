"""What a run resumes from and how, decided once before the engine is built: the checkpoint (verified), its
trainer state and config (each read once), and whether DeepSpeed's exact resume or an elastic one applies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from megatransformer import checkpoint as ckpt
from megatransformer.checkpoint.sharded import INDEX, finish_conversions
from megatransformer.config import ConfigError, RunConfig
from megatransformer.training.runtime.distributed import on_first_rank
from megatransformer.training.runtime.layout import (
    BatchSizes,
    data_parallel_size,
    engine_zero_stage,
    exact_batch_overrides,
    keep_global_batch,
    resolve_batch_sizes,
    validation_rows,
)


@dataclass
class ElasticResume:
    """A resume on another layout: the engine is built for the new one from the saved weights."""

    saved_sizes: BatchSizes
    sizes: BatchSizes
    zero_stage: int  # the stage the new engine runs (layout.engine_zero_stage)


@dataclass
class ResumePlan:
    path: Path
    state: ckpt.TrainerState  # its trainer.json
    saved: RunConfig  # its config.yaml
    elastic: ElasticResume | None  # None: the layout that wrote it

    def describe(self, cfg: RunConfig, world_size: int) -> str:
        s = self.state
        if self.elastic is None:
            return f"resumed from {self.path} at step {s.step} ({s.tokens:,} tokens seen)"
        old, new = self.elastic.saved_sizes, self.elastic.sizes
        was = _layout(old.dp, s.tensor_parallel, s.sequence_parallel, s.zero_stage)
        now = _layout(new.dp, cfg.parallel.tensor_parallel, cfg.parallel.sequence_parallel, self.elastic.zero_stage)
        line = (
            f"resuming step {s.step} written by {_ranks(s.world_size)} ({was}) on {_ranks(world_size)} ({now}): "
            f"micro {new.micro} x accum {new.accum} (was micro {old.micro} x accum {old.accum})"
        )
        if new.global_batch != old.global_batch:
            line += (
                f"; global batch {old.global_batch} -> {new.global_batch} (resume_elastic=allow_batch_change): "
                "not an exact continuation"
            )
        return line


def check_run_dir(cfg: RunConfig) -> None:
    """Cheap checks every rank makes before any process group: a ``resume=PATH`` that names no complete
    checkpoint fails now (its files are verified later), and a fresh run never overwrites an old one."""
    if cfg.resume not in (None, "auto"):
        ckpt.find_checkpoint(cfg.resume, f"resume={cfg.resume}")
    if Path(cfg.run_dir).exists() and not Path(cfg.run_dir).is_dir():
        raise ConfigError(f"run_dir={cfg.run_dir} is a file, not a directory; choose another run_dir")
    existing = ckpt.latest_checkpoint(ckpt.checkpoints_dir(cfg.run_dir))
    # (a branch that has checkpoints of its own keeps its start in them: the source is not read again)
    if cfg.schedule.decay_from is not None and not (cfg.resume == "auto" and existing is not None):
        branch = ckpt.find_checkpoint(cfg.schedule.decay_from, f"schedule.decay_from={cfg.schedule.decay_from}")
        if branch.resolve().is_relative_to(Path(cfg.run_dir).resolve()):
            raise ConfigError(
                f"schedule.decay_from={cfg.schedule.decay_from} is a checkpoint of run_dir={cfg.run_dir}: give the "
                "decay a run_dir of its own"
            )
    if cfg.resume is None and existing is not None:
        raise ConfigError(
            f"run_dir={cfg.run_dir} already holds checkpoints (latest: {existing.name}); pass "
            "resume=auto to continue that run, or choose a new run_dir"
        )


def keep_saved_batch(cfg: RunConfig, world_size: int) -> tuple[RunConfig, str | None]:
    """``cfg`` for the checkpoint this run will resume from (unverified: read before any process group, the same
    on every rank), and a line to print when it changes: the checkpoint's global batch and validation rows are
    kept, the micro batch and accumulation derived for this world size (docs/checkpoints.md, elastic resume).
    Left as it is: a fresh run, ``resume_elastic=allow_batch_change``, a config that sets another
    ``train.global_batch_size`` (refused later, with the overrides that continue exactly), and a global batch
    this layout cannot split (refused later too)."""
    try:
        path = _resume_source(cfg)
        if path is None:
            return cfg, None
        state, saved = ckpt.read_trainer_state(path), ckpt.saved_config(path)
        saved_sizes = resolve_batch_sizes(
            saved.train, state.world_size // (state.tensor_parallel * state.sequence_parallel)
        )
        dp = data_parallel_size(cfg, world_size)
    except ConfigError:  # (a damaged checkpoint or a layout that cannot be: said where it is verified)
        return cfg, None
    total, train = saved_sizes.global_batch, cfg.train
    if cfg.resume_elastic == "allow_batch_change" or train.global_batch_size not in (None, total):
        return cfg, None
    sizes = keep_global_batch(train, total, dp)
    if sizes is None:
        return cfg, None
    try:
        before = resolve_batch_sizes(train, dp)
    except ConfigError:
        before = None
    if before == sizes:
        return cfg, None
    rows = validation_rows(train)  # (in the config's micro batch: the same rows as before the micro batch changes)
    update = {"micro_batch_size": sizes.micro, "grad_accum": sizes.accum, "global_batch_size": total, "eval_rows": rows}
    kept = cfg.model_copy(update={"train": train.model_copy(update=update)})
    config = (
        f"the config's micro {before.micro} x accum {before.accum} would make it {before.global_batch}; "
        if before
        else ""
    )
    return kept, (
        f"resume: keeping the checkpoint's global batch {total} on {dp} data-parallel rank{'s' * (dp != 1)}: "
        f"micro {sizes.micro} x accum {sizes.accum} ({config}validation stays {rows} rows; "
        "resume_elastic=allow_batch_change trains with the config's batch instead)"
    )


def _resume_source(cfg: RunConfig) -> Path | None:
    """The checkpoint a run will start from, unverified (:func:`resolve_resume` verifies it later)."""
    if cfg.resume == "auto":
        own = ckpt.latest_checkpoint(ckpt.checkpoints_dir(cfg.run_dir))
        if own is not None or cfg.schedule.decay_from is None:
            return own
    elif cfg.resume is None and cfg.schedule.decay_from is None:
        return None
    key, value = _source(cfg)
    return ckpt.find_checkpoint(value, f"{key}={value}")


def resolve_resume(cfg: RunConfig, found: Sequence[ckpt.CheckpointDamaged] = ()) -> Path | None:
    """The checkpoint to resume from: ``auto`` -> the newest intact one (none of those the ranks ``found``
    damaged loading them) or None (fresh start); a path (a step directory, a checkpoints or run directory's
    latest) must exist and be intact. Intact here: its manifest, every file's size, and the contents of all but
    the ranks' parts (:func:`ckpt.is_rank_part`), which each rank verifies as it loads the ones it reads.

    With a process group, rank 0 alone reads and verifies and tells the others its answer (or its error),
    so every rank takes the same checkpoint, or fails with the same message, before any engine load."""
    return on_first_rank(lambda: _resolve_resume(cfg, found))


def _resolve_resume(cfg: RunConfig, found: Sequence[ckpt.CheckpointDamaged]) -> Path | None:
    """(schedule.decay_from: where a run that has no checkpoint of its own starts.)"""
    branch = cfg.schedule.decay_from
    if cfg.resume == "auto":
        root = ckpt.checkpoints_dir(cfg.run_dir)
        if root.is_dir():
            for line in finish_conversions(root):  # (the checkpoint a kill hid mid-conversion)
                ckpt.warn(line)
        own = ckpt.newest_intact(root, found, rank_parts=False)
        if own is not None or branch is None:
            return own
    elif cfg.resume is None and branch is None:
        return None
    key, value = _source(cfg)
    path = ckpt.find_checkpoint(value, f"{key}={value}")
    try:
        ckpt.verify_checkpoint(path, rank_parts=False)
    except ckpt.CheckpointDamaged as err:
        raise refusal(cfg, err) from None
    return path


def _source(cfg: RunConfig) -> tuple[str, str]:
    """The setting that names the checkpoint a run starts from, beside resume=auto's own ones."""
    branch = cfg.schedule.decay_from
    return ("resume", cfg.resume) if branch is None else ("schedule.decay_from", branch)


def refusal(cfg: RunConfig, err: ckpt.CheckpointDamaged) -> Exception:
    """The error that ends a run told to start from a checkpoint in which ``err`` was found: the setting that
    names it and what to do; an unsafe file's refusal as it is."""
    if isinstance(err, ckpt.CheckpointUnsafe):
        return err
    key, value = _source(cfg)
    return ConfigError(f"{key}={value}: {err}; resume from another checkpoint (resume=auto skips damaged ones)")


def skippable(cfg: RunConfig, err: ckpt.CheckpointDamaged) -> bool:
    """Whether resume=auto goes on to an older checkpoint after a rank found ``err`` loading this one: a damaged
    (not an unsafe) file of one of the run's own checkpoints."""
    own = err.checkpoint.parent.resolve() == ckpt.checkpoints_dir(cfg.run_dir).resolve()
    return cfg.resume == "auto" and own and not isinstance(err, ckpt.CheckpointUnsafe)


def decay_start(cfg: RunConfig, plan: ResumePlan | None) -> ckpt.DecayOrigin | None:
    """Where this run's decay begins (None without schedule.decay_from): the origin its own checkpoint keeps
    (``plan``: the resume), so that a restart decays from where the branch first did, even when decay_from names
    a run that has gone on since; at the branch's first start, schedule.decay_from's checkpoint, which must be of
    a stable phase (a wsd or constant schedule's, past its warm-up and before its decay)."""
    value = cfg.schedule.decay_from
    if value is None:
        return None
    if plan is not None and plan.path.parent.resolve() == ckpt.checkpoints_dir(cfg.run_dir).resolve():
        if plan.state.decay_from is not None:
            return plan.state.decay_from
        # (a checkpoint of a version that kept no origin: the source's step, as that version read it)
        source = ckpt.find_checkpoint(value, f"schedule.decay_from={value}")
        return ckpt.DecayOrigin(checkpoint=str(source), step=ckpt.read_trainer_state(source).step)
    path = plan.path if plan is not None else ckpt.find_checkpoint(value, f"schedule.decay_from={value}")
    state = plan.state if plan is not None else ckpt.read_trainer_state(path)
    saved = plan.saved if plan is not None else ckpt.saved_config(path)
    check_stable(value, path, state, saved)
    return ckpt.DecayOrigin(checkpoint=str(path), step=state.step)


def check_stable(value: str, path: Path, state: ckpt.TrainerState, saved: RunConfig) -> None:
    """Refuse a decay_from checkpoint that is not of a stable phase: one that has decayed (a decay's own, or a
    wsd run's past its decay's start), one of a cosine, linear or inverse_sqrt run (no stable phase: its rate
    falls from the warm-up's end), or one still in its warm-up."""
    from megatransformer.training.optimizers.schedules import schedule_phase, wsd_decay_steps

    s = saved.schedule
    phase = state.schedule_phase or schedule_phase(saved, state.step)
    if phase == "stable" and s.name in ("wsd", "constant"):
        return
    where = f"schedule.decay_from={value}: {path} is at step {state.step} of a {s.name} schedule"
    if s.name not in ("wsd", "constant"):
        why = f"{where}, which has no stable phase (its rate falls from the end of its warm-up)"
        fix = "branch decays from a wsd run's checkpoints (schedule.name=wsd)"
    elif phase == "decay":
        why = f"{where}, in its decay: it has decayed already, and a branch would raise the rate and decay again"
        first, last = s.warmup_steps, saved.train.max_steps - wsd_decay_steps(saved)
        fix = f"name a checkpoint of its stable phase (steps {first} to {last} of that run)"
        if s.decay_from is not None or state.decay_from is not None:
            fix = "name a checkpoint of the stable run it was branched from"
    else:
        why = f"{where}, in its warm-up (steps up to {s.warmup_steps})"
        fix = "name a checkpoint of its stable phase, after the warm-up"
    raise ConfigError(f"{why}; {fix}")


def plan_resume(
    cfg: RunConfig,
    world_size: int,
    device_type: str,
    tokenizer_sha256: str | None,
    verified: Path | None = None,
    found: Sequence[ckpt.CheckpointDamaged] = (),
) -> ResumePlan | None:
    """The resume of this run (from ``cfg.resume``, or from the ``verified`` checkpoint a rollback found; none of
    those ``found`` damaged), or None for a fresh start. Refuses another model shape, another tokenizer and (unless
    ``resume_elastic=allow_batch_change``) another global batch; an elastic resume loads the saved weights
    here, since the engine is built from them."""
    path = verified or resolve_resume(cfg, found)
    if path is None:
        return None
    state, saved = ckpt.read_trainer_state(path), ckpt.saved_config(path)
    ckpt.check_same_shapes(saved.model, cfg.model, f"checkpoint {path}")
    check_tokenizer(path, state, cfg, tokenizer_sha256)
    if saved.optim.name != cfg.optim.name:
        raise ConfigError(
            f"checkpoint {path} was trained with optim.name={saved.optim.name}, this run says {cfg.optim.name}: "
            f"its optimizer state is {saved.optim.name}'s; resume with optim.name={saved.optim.name}, or start a "
            f"new run from its weights with init_from={path}"
        )
    tp, sp = cfg.parallel.tensor_parallel, cfg.parallel.sequence_parallel
    saved_sizes = resolve_batch_sizes(
        saved.train, state.world_size // (state.tensor_parallel * state.sequence_parallel)
    )
    sizes = resolve_batch_sizes(cfg.train, data_parallel_size(cfg, world_size))
    if sizes.global_batch != saved_sizes.global_batch and cfg.resume_elastic != "allow_batch_change":
        exact = exact_batch_overrides(cfg.train, saved_sizes.global_batch, sizes.dp)
        how = (
            f"set {' '.join(exact)} to continue exactly, or "
            if exact
            else f"it does not divide among {sizes.dp} data-parallel ranks; "
        )
        raise ConfigError(
            f"checkpoint {path} was trained with global batch {saved_sizes.global_batch} (micro "
            f"{saved_sizes.micro} x accum {saved_sizes.accum} x dp {saved_sizes.dp}), this run's is "
            f"{sizes.global_batch} (micro {sizes.micro} x accum {sizes.accum} x dp {sizes.dp}); {how}"
            "resume_elastic=allow_batch_change to continue with the new batch"
        )
    zero_stage = engine_zero_stage(cfg, sizes.dp, device_type)
    if not (path / INDEX).is_file():
        raise ConfigError(
            f"checkpoint {path} is in the format before sharded checkpoints (DeepSpeed's states and "
            f"{ckpt.WEIGHTS}); convert it with `megatransformer checkpoint convert {path}`, or start a new run "
            f"from its weights with init_from={path}"
        )
    saved_layout = (state.world_size, state.tensor_parallel, state.sequence_parallel, state.zero_stage)
    if saved_layout == (world_size, tp, sp, zero_stage):
        return ResumePlan(path, state, saved, None)
    return ResumePlan(path, state, saved, ElasticResume(saved_sizes, sizes, zero_stage))


def rollback_target(cfg: RunConfig, before_step: int) -> Path | None:
    """The newest intact checkpoint of the run older than ``before_step`` (damaged ones skipped with a
    warning), or None; rank 0 verifies, every rank gets its answer."""

    def find() -> Path | None:
        for path in ckpt.complete_before(ckpt.checkpoints_dir(cfg.run_dir), before_step):
            try:
                ckpt.verify_checkpoint(path, rank_parts=False)
            except ckpt.CheckpointDamaged as err:
                ckpt.warn(f"{err}: skipped, looking for an older checkpoint to roll back to")
                continue
            return path
        return None

    return on_first_rank(find)


def check_tokenizer(path: Path, state: ckpt.TrainerState, cfg: RunConfig, tokenizer_sha256: str | None) -> None:
    if state.tokenizer_sha256 is None:
        ckpt.warn(
            f"checkpoint {path} records no tokenizer hash: that data.tokenizer={cfg.data.tokenizer} is the one it "
            "was trained with cannot be checked"
        )
    if tokenizer_sha256 and state.tokenizer_sha256 and tokenizer_sha256 != state.tokenizer_sha256:
        raise ConfigError(
            f"checkpoint {path} was trained with another tokenizer (sha256 "
            f"{state.tokenizer_sha256[:12]}, data.tokenizer={cfg.data.tokenizer} has "
            f"{tokenizer_sha256[:12]}); resume with the same tokenizer, or start a new run "
            "with init_from="
        )


def _ranks(n: int) -> str:
    return f"{n} rank" + ("s" if n != 1 else "")


def _layout(dp: int, tp: int, sp: int, zero: int) -> str:
    return f"dp{dp}, tp{tp}, " + (f"sp{sp}, " if sp > 1 else "") + f"zero{zero}"
