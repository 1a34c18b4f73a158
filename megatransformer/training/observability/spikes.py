"""Loss spikes: which steps spike (their loss or their gradient norm), and the ladder of answers (skip the
update; roll back and skip the data; stop). docs/spikes.md describes the design.

Every rank takes the same decisions: they are made from the step's all-reduced loss and gradient norm. The
update's fate is decided on the device against :meth:`SpikeLadder.limits` (the engine's optimizer skips by it),
and the ladder learns the step's numbers when the host reads them, one step later on a step that logs nothing:
detection adds no wait for the device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from megatransformer import checkpoint as ckpt
from megatransformer.config import SpikesConfig
from megatransformer.training.observability.metrics import finite_or_none

ROBUST_SIGMA = 1.4826  # the MAD of normally distributed values times this is their standard deviation
RECENT_STEPS = 20  # the newest accepted values: their median is the level a spike rises from
SKIP, ROLLBACK, STOP = "skip", "rollback", "stop"
LOSS, GRAD_NORM = "loss", "grad_norm"  # the quantities judged
NAMES = {LOSS: "loss", GRAD_NORM: "gradient norm"}
LOG = "spikes.json"  # RUN_DIR/spikes.json: the ladder's state right after the last rollback (RollbackLog)


class SpikeDetector:
    """One quantity's recent accepted values (a ring of ``window`` of them) and the threshold they give
    (:func:`robust_threshold`); a value is a spike when it is non-finite or lies above :meth:`threshold`."""

    def __init__(self, cfg: SpikesConfig, values: list[float] = (), quantity: str = LOSS) -> None:
        self.cfg = cfg
        self.threshold_sigmas, self.min_rise = (
            (cfg.threshold, cfg.min_rise) if quantity == LOSS else (cfg.grad_norm_threshold, cfg.grad_norm_min_rise)
        )
        self.ring = np.empty(cfg.window)
        self.count = 0  # values seen; the ring holds the last min(count, window)
        self._threshold: float | None = None
        for value in list(values)[-cfg.window :]:
            self.add(value)

    @property
    def values(self) -> list[float]:
        """The values of the statistic, oldest first."""
        return self._ordered().tolist()

    def _ordered(self) -> np.ndarray:
        n, at = min(self.count, self.cfg.window), self.count % self.cfg.window
        return np.concatenate([self.ring[at:], self.ring[:at]]) if n == self.cfg.window else self.ring[:n]

    def threshold(self) -> float | None:
        """The value above which a step spikes; None while fewer than ``warmup`` values are known."""
        return self._threshold

    def beyond(self, value: float) -> bool:
        """Whether ``value`` is non-finite or above the threshold."""
        return not math.isfinite(value) or (self._threshold is not None and value > self._threshold)

    def rejects(self, value: float) -> bool:
        """Whether a step with ``value`` spikes; a value that does not joins the statistic."""
        if self.beyond(value):
            return True
        self.add(value)
        return False

    def add(self, value: float) -> None:
        self.ring[self.count % self.cfg.window] = value
        self.count += 1
        n = min(self.count, self.cfg.window)
        self._threshold = (
            robust_threshold(self._ordered(), self.threshold_sigmas, self.min_rise) if n >= self.cfg.warmup else None
        )


def robust_threshold(values: np.ndarray, sigmas: float, min_rise: float) -> float:
    """level + max(sigmas x noise, min_rise x level) of ``values`` (oldest first). The level is the median of
    the newest :data:`RECENT_STEPS`; the noise a robust sigma that a trend does not inflate: the larger of the
    step-to-step differences' (a trend, such as the run's early descent, moves them all alike; the MAD of the
    values themselves would count it as noise) and the newest values' own spread around the level (data that
    changes over a few steps, as data read in order does)."""
    recent = values[-RECENT_STEPS:]
    level = _median(recent)
    steps = np.diff(values)
    around_trend = ROBUST_SIGMA * _median(np.abs(steps - _median(steps))) / math.sqrt(2) if len(steps) else 0.0
    noise = max(around_trend, ROBUST_SIGMA * _median(np.abs(recent - level)))
    return level + max(sigmas * noise, min_rise * abs(level))


def _median(values: np.ndarray) -> float:
    """np.median's value, by a partial sort: a few times faster on the short arrays of a window."""
    half = len(values) // 2
    if len(values) % 2:
        return float(np.partition(values, half)[half])
    low, high = np.partition(values, [half - 1, half])[half - 1 : half + 1]
    return float(low + high) / 2


class DeadRun:
    """A model that no longer learns: its gradient norm is 0 (at most :data:`VANISHED`), or (past the warm-up)
    its loss is ln(vocab), that of a uniform output, to within :data:`UNIFORM_TOLERANCE`. Neither is a spike
    (nothing rises) nor non-finite, so the ladder never sees it; ``limit`` consecutive such steps stop the run
    (train.max_dead_steps)."""

    def __init__(self, vocab_size: int, limit: int, after_step: int = 0) -> None:
        self.uniform_loss = math.log(vocab_size)
        self.limit, self.after_step = limit, after_step
        self.since: int | None = None  # the first step of the current run of dead steps
        self.seen: str = ""  # what the newest dead step showed

    def see(self, step: int, loss: float, grad_norm: float | None) -> str | None:
        """Judge step ``step``; returns the stop's reason once ``limit`` dead steps in a row have been seen."""
        vanished = grad_norm is not None and grad_norm <= VANISHED
        uniform = step > self.after_step and abs(loss - self.uniform_loss) <= UNIFORM_TOLERANCE
        if not self.limit or not (vanished or uniform):
            self.since = None
            return None
        if self.since is None:
            self.since = step
        self.seen = " and ".join(
            ([f"a gradient norm of {grad_norm:.3g}"] if vanished else [])
            + ([f"a loss of {loss:.4f}, ln(vocab) {self.uniform_loss:.4f}: a uniform output"] if uniform else [])
        )
        if step - self.since + 1 < self.limit:
            return None
        return (
            f"stopping: step {step}: the model has stopped learning, {step - self.since + 1} steps in a row since "
            f"step {self.since} (train.max_dead_steps={self.limit}), the last with {self.seen}; lower optim.lr "
            "(or optim.muon_lr), raise schedule.warmup_steps, or check model.init_std"
        )


UNIFORM_TOLERANCE = 1e-4  # a loss this close to ln(vocab) is a uniform output's (a fresh small model: ~1e-3 above)
VANISHED = 1e-12  # a gradient norm this small moves no weight: a model's own is many orders of magnitude larger


@dataclass
class SpikeEvent:
    action: str  # skip | rollback | stop
    step: int
    loss: float
    threshold: float | None  # the loss's
    began: int  # the first spike of the run of spikes that led here
    spiked: list[str]  # the quantities beyond their threshold (LOSS, GRAD_NORM)
    grad_norm: float | None = None  # None: not computed by the engine
    grad_norm_threshold: float | None = None

    def record(self, rollbacks: int) -> dict[str, Any]:
        """The event as a metrics.jsonl record (``rollbacks``: those before it, which tells the run's
        trajectories apart: the steps after a rollback are run again)."""
        return {
            "step": self.step,
            "event": self.action,
            "spiked": self.spiked,
            "spike_loss": finite_or_none(self.loss),
            "threshold": self.threshold,
            "spike_grad_norm": finite_or_none(self.grad_norm),
            "grad_norm_threshold": self.grad_norm_threshold,
            "spike_began": self.began,
            "rollbacks": rollbacks,
        }


class SpikeLadder:
    """The response to spikes, with the state a checkpoint keeps (:meth:`state_dict`): the detectors' values,
    the recent spikes, the rollbacks so far and the global row ranges they skipped."""

    def __init__(self, cfg: SpikesConfig, state: dict[str, Any] | None = None) -> None:
        state = state or {}
        self.cfg = cfg
        self._restore_detectors(state)
        self.recent: list[int] = list(state.get("recent", []))
        self.rollbacks: int = state.get("rollbacks", 0)
        self.skip_rows: list[list[int]] = [list(r) for r in state.get("skip_rows", [])]

    def _restore_detectors(self, state: dict[str, Any]) -> None:
        """The detectors as ``state`` had them (one without ``grad_norms``, of an older version, starts the
        gradient norm's warm-up again)."""
        self.detector = SpikeDetector(self.cfg, state.get("losses", []))
        self.grad_norm_detector = (
            SpikeDetector(self.cfg, state.get("grad_norms", []), GRAD_NORM) if self.cfg.grad_norm else None
        )

    def spiked(self, loss: float, grad_norm: float | None = None) -> list[str]:
        """The quantities of a step beyond their threshold (a non-finite gradient norm always is; a finite one
        only where the gradient norm is judged; None: the engine computed none)."""
        spiked = [LOSS] if self.detector.beyond(loss) else []
        if grad_norm is not None and (
            not math.isfinite(grad_norm) or (self.grad_norm_detector and self.grad_norm_detector.beyond(grad_norm))
        ):
            spiked.append(GRAD_NORM)
        return spiked

    def limits(self) -> tuple[float, float]:
        """The loss and the gradient norm above which a finite step spikes now (infinite: none), the values
        :meth:`rejects` compares a finite step's with."""
        if not self.cfg.enabled:
            return math.inf, math.inf
        loss = self.detector.threshold()
        norm = self.grad_norm_detector.threshold() if self.grad_norm_detector is not None else None
        return (math.inf if loss is None else loss), (math.inf if norm is None else norm)

    def rejects(self, loss: float, grad_norm: float | None = None) -> bool:
        """Whether the step with this (all-reduced) loss and gradient norm must not update the model; a step
        that may joins the statistics."""
        if not self.cfg.enabled:
            return False
        if self.spiked(loss, grad_norm):
            return True
        self.detector.add(loss)
        if self.grad_norm_detector is not None and grad_norm is not None:
            self.grad_norm_detector.add(grad_norm)
        return False

    def respond(self, step: int, loss: float, grad_norm: float | None = None) -> SpikeEvent:
        """The answer to a spike at ``step``: skip its update; roll back when it is the ``rollback_after``-th
        within ``within`` steps; stop when no rollback is left."""
        self.recent = [s for s in self.recent if s > step - self.cfg.within] + [step]
        action = SKIP
        if len(self.recent) >= self.cfg.rollback_after:
            action = ROLLBACK if self.rollbacks < self.cfg.max_rollbacks else STOP
        norm_threshold = self.grad_norm_detector.threshold() if self.grad_norm_detector else None
        spiked = self.spiked(loss, grad_norm) or [LOSS]  # (a step found non-finite where no quantity tells)
        return SpikeEvent(
            action, step, loss, self.detector.threshold(), self.recent[0], spiked, grad_norm, norm_threshold
        )

    def protect_before(self) -> int | None:
        """While spikes are recent, the newest checkpoint before the first of them is what a rollback needs."""
        return self.recent[0] if self.recent else None

    def rolled_back(self, rows: tuple[int, int], restored: dict[str, Any]) -> None:
        """After a rollback that skips global ``rows``: the statistics as the checkpoint had them (``restored``,
        its ladder state), no recent spikes, one rollback more."""
        self._restore_detectors(restored)
        self.recent = []
        self.rollbacks += 1
        self.skip_rows.append(list(rows))

    def state_dict(self) -> dict[str, Any]:
        state = {
            "losses": self.detector.values,
            "recent": list(self.recent),
            "rollbacks": self.rollbacks,
            "skip_rows": [list(r) for r in self.skip_rows],
        }
        if self.grad_norm_detector is not None:
            state["grad_norms"] = self.grad_norm_detector.values
        return state


class RollbackLog(BaseModel):
    """RUN_DIR/spikes.json: the ladder's state right after a rollback, tied to the checkpoint rolled back to
    (its name and the sha256 of its manifest, which no other run's checkpoint shares)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    checkpoint: str
    manifest_sha256: str
    state: ckpt.SpikeState


def resume_state(checkpoint: Path, saved: ckpt.SpikeState, run_dir: str | Path) -> dict[str, Any]:
    """The ladder state to resume from ``checkpoint`` with: its own (``saved``), or the run's rollback log when
    the log was written by a rollback to this very checkpoint (a run killed after a rollback skips the data
    again). A log of an older checkpoint is superseded by this one's state; a damaged log, or one of a
    checkpoint this one is not, is ignored with one line."""
    path = Path(run_dir) / LOG
    if not path.is_file():
        return saved.ladder_state()
    try:
        log = RollbackLog.model_validate_json(path.read_bytes())
    except (OSError, ValidationError) as err:
        reason = err.errors()[0]["msg"] if isinstance(err, ValidationError) else err.__class__.__name__
        ckpt.warn(f"{path} is damaged ({reason}): ignored; resuming with the loss-spike state of {checkpoint.name}")
        return saved.ladder_state()
    if log.checkpoint == checkpoint.name and log.manifest_sha256 == manifest_sha256(checkpoint):
        return log.state.ladder_state() if log.state.rollbacks > saved.rollbacks else saved.ladder_state()
    logged, resumed = ckpt.step_of(Path(log.checkpoint)), ckpt.step_of(checkpoint)
    if logged is None or resumed is None or logged >= resumed:  # (older: a rollback this checkpoint's state holds)
        ckpt.warn(
            f"{path} records a rollback to {log.checkpoint}, not to this run's {checkpoint.name} (another run's, "
            f"or a checkpoint skipped): ignored; resuming with the loss-spike state of {checkpoint.name}"
        )
    return saved.ladder_state()


def write_log(run_dir: str | Path, state: dict[str, Any], checkpoint: Path) -> None:
    """Record the ladder's state after a rollback to ``checkpoint`` in RUN_DIR/spikes.json (replaced
    atomically)."""
    log = RollbackLog(
        checkpoint=checkpoint.name,
        manifest_sha256=manifest_sha256(checkpoint),
        state=ckpt.SpikeState.model_validate(state),
    )
    ckpt.atomic_write(Path(run_dir) / LOG, log.model_dump_json() + "\n")


def manifest_sha256(checkpoint: Path) -> str:
    return ckpt.file_entry(checkpoint / ckpt.COMPLETE)["sha256"]


def describe(
    event: SpikeEvent,
    rows: tuple[int, int] | None = None,
    checkpoint: str | None = None,
    rollbacks: int = 0,
    max_rollbacks: int = 0,
) -> str:
    """The console line of an event: the quantities that spiked, each with its value and threshold."""
    values = {LOSS: (event.loss, event.threshold), GRAD_NORM: (event.grad_norm, event.grad_norm_threshold)}
    parts = []
    for quantity in event.spiked:
        value, limit = values[quantity]
        parts.append(
            f"{NAMES[quantity]} {_shown(quantity, value)}"
            + ("" if limit is None else f" (threshold {_shown(quantity, limit)})")
        )
    head = f"step {event.step}: {' and '.join(NAMES[q] for q in event.spiked)} spike, {', '.join(parts)}"
    if event.action == SKIP:
        return f"{head}: update skipped"
    if event.action == ROLLBACK:
        return (
            f"{head}: spikes since step {event.began}: rolled back to {checkpoint}, skipping global rows "
            f"[{rows[0]:,}, {rows[1]:,}) (rollback {rollbacks} of {max_rollbacks})"
        )
    return head


def _shown(quantity: str, value: float | None) -> str:
    if value is None or not math.isfinite(value):
        return "non-finite"
    return f"{value:.4f}" if quantity == LOSS else f"{value:.4g}"
