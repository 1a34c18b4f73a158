"""Loss spikes: which steps spike, and the ladder of answers (skip the update; roll back and skip the data;
stop). docs/spikes.md describes the design.

Every rank takes the same decisions: they are made from the step's all-reduced loss, which every rank reads
anyway, so detection adds no wait for the device.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from megatransformer.config import SpikesConfig

ROBUST_SIGMA = 1.4826  # the MAD of normally distributed values times this is their standard deviation
SKIP, ROLLBACK, STOP = "skip", "rollback", "stop"
LOG = "spikes.json"  # RUN_DIR/spikes.json: the ladder's state right after the last rollback


class SpikeDetector:
    """A running median and MAD of the recent accepted losses (a ring of ``window`` of them); a loss is a
    spike when it is non-finite or lies above :meth:`threshold`."""

    def __init__(self, cfg: SpikesConfig, losses: list[float] = ()) -> None:
        self.cfg = cfg
        self.ring = np.empty(cfg.window)
        self.count = 0  # losses seen; the ring holds the last min(count, window)
        self._threshold: float | None = None
        for loss in list(losses)[-cfg.window :]:
            self._add(loss)

    @property
    def losses(self) -> list[float]:
        """The losses of the statistic, oldest first."""
        n, at = min(self.count, self.cfg.window), self.count % self.cfg.window
        return (np.concatenate([self.ring[at:], self.ring[:at]]) if n == self.cfg.window else self.ring[:n]).tolist()

    def threshold(self) -> float | None:
        """The loss above which a step spikes; None while fewer than ``warmup`` losses are known."""
        return self._threshold

    def rejects(self, loss: float) -> bool:
        """Whether a step with ``loss`` spikes; a loss that does not joins the statistic."""
        if not math.isfinite(loss) or (self._threshold is not None and loss > self._threshold):
            return True
        self._add(loss)
        return False

    def _add(self, loss: float) -> None:
        self.ring[self.count % self.cfg.window] = loss
        self.count += 1
        n = min(self.count, self.cfg.window)
        self._threshold = robust_threshold(self.ring[:n], self.cfg) if n >= self.cfg.warmup else None


def robust_threshold(losses: np.ndarray, cfg: SpikesConfig) -> float:
    """median + max(threshold x robust sigma, min_rise x median) of ``losses``."""
    median = _median(losses)
    spread = ROBUST_SIGMA * _median(np.abs(losses - median))
    return median + max(cfg.threshold * spread, cfg.min_rise * abs(median))


def _median(values: np.ndarray) -> float:
    """np.median's value, by a partial sort: a few times faster on the short arrays of a window."""
    half = len(values) // 2
    if len(values) % 2:
        return float(np.partition(values, half)[half])
    low, high = np.partition(values, [half - 1, half])[half - 1 : half + 1]
    return float(low + high) / 2


@dataclass
class SpikeEvent:
    action: str  # skip | rollback | stop
    step: int
    loss: float
    threshold: float | None
    began: int  # the first spike of the run of spikes that led here

    def record(self, rollbacks: int) -> dict[str, Any]:
        """The event as a metrics.jsonl record (``rollbacks``: those before it, which tells the run's
        trajectories apart: the steps after a rollback are run again)."""
        return {
            "step": self.step,
            "event": self.action,
            "spike_loss": self.loss if math.isfinite(self.loss) else None,
            "threshold": self.threshold,
            "spike_began": self.began,
            "rollbacks": rollbacks,
        }


class SpikeLadder:
    """The response to spikes, with the state a checkpoint keeps (:meth:`state_dict`): the detector's
    losses, the recent spikes, the rollbacks so far and the global row ranges they skipped."""

    def __init__(self, cfg: SpikesConfig, state: dict[str, Any] | None = None) -> None:
        state = state or {}
        self.cfg = cfg
        self.detector = SpikeDetector(cfg, state.get("losses", []))
        self.recent: list[int] = list(state.get("recent", []))
        self.rollbacks: int = state.get("rollbacks", 0)
        self.skip_rows: list[list[int]] = [list(r) for r in state.get("skip_rows", [])]

    def rejects(self, loss: float) -> bool:
        """Whether the step with this (all-reduced) loss must not update the model."""
        return self.cfg.enabled and self.detector.rejects(loss)

    def respond(self, step: int, loss: float) -> SpikeEvent:
        """The answer to a spike at ``step``: skip its update; roll back when it is the ``rollback_after``-th
        within ``within`` steps; stop when no rollback is left."""
        self.recent = [s for s in self.recent if s > step - self.cfg.within] + [step]
        action = SKIP
        if len(self.recent) >= self.cfg.rollback_after:
            action = ROLLBACK if self.rollbacks < self.cfg.max_rollbacks else STOP
        return SpikeEvent(action, step, loss, self.detector.threshold(), self.recent[0])

    def protect_before(self) -> int | None:
        """While spikes are recent, the newest checkpoint before the first of them is what a rollback needs."""
        return self.recent[0] if self.recent else None

    def rolled_back(self, rows: tuple[int, int], restored: dict[str, Any]) -> None:
        """After a rollback that skips global ``rows``: the statistic as the checkpoint had it (``restored``,
        its ladder state), no recent spikes, one rollback more."""
        self.detector = SpikeDetector(self.cfg, restored.get("losses", []))
        self.recent = []
        self.rollbacks += 1
        self.skip_rows.append(list(rows))

    def state_dict(self) -> dict[str, Any]:
        return {
            "losses": list(self.detector.losses),
            "recent": list(self.recent),
            "rollbacks": self.rollbacks,
            "skip_rows": [list(r) for r in self.skip_rows],
        }


def resume_state(checkpoint: dict[str, Any], run_dir: str | Path) -> dict[str, Any]:
    """The ladder state to resume with: the checkpoint's, unless the run's rollback log records more
    rollbacks, taken after that checkpoint was saved (a run killed after a rollback skips the data again)."""
    path = Path(run_dir) / LOG
    logged = json.loads(path.read_text()) if path.is_file() else {}
    return logged if logged.get("rollbacks", 0) > checkpoint.get("rollbacks", 0) else checkpoint


def write_log(run_dir: str | Path, state: dict[str, Any]) -> None:
    """Record the ladder's state after a rollback in RUN_DIR/spikes.json (replaced atomically)."""
    path = Path(run_dir) / LOG
    tmp = path.with_name(f".{LOG}.tmp")
    tmp.write_text(json.dumps(state) + "\n")
    os.replace(tmp, path)


def describe(
    event: SpikeEvent,
    rows: tuple[int, int] | None = None,
    checkpoint: str | None = None,
    rollbacks: int = 0,
    max_rollbacks: int = 0,
) -> str:
    """The console line of an event."""
    loss = f"{event.loss:.4f}" if math.isfinite(event.loss) else "non-finite"
    limit = "" if event.threshold is None else f" (threshold {event.threshold:.4f})"
    head = f"step {event.step}: loss spike, loss {loss}{limit}"
    if event.action == SKIP:
        return f"{head}: update skipped"
    if event.action == ROLLBACK:
        return (
            f"{head}: spikes since step {event.began}: rolled back to {checkpoint}, skipping global rows "
            f"[{rows[0]:,}, {rows[1]:,}) (rollback {rollbacks} of {max_rollbacks})"
        )
    return head
