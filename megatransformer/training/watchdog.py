"""Hang diagnosis: a per-rank watchdog that writes every thread's Python stack of its rank to
RUN_DIR/hangs/rank_NNNNN.txt when a step takes far longer than usual, before parallel.timeout_minutes ends
the run; and, on CUDA, NCCL's flight recorder switched on (docs/spikes.md).

The watchdog is faulthandler's: a C thread that needs neither the GIL nor a responsive main thread, so it
writes the stacks of a rank stuck inside a collective, or in C code holding the GIL.
"""

from __future__ import annotations

import faulthandler
import os
import statistics
from collections import deque
from pathlib import Path

from megatransformer.config import RunConfig

HANGS = "hangs"
TIMEOUT_SHARE = 0.8  # a dump comes at the latest after this share of parallel.timeout_minutes
SETTLED_STEPS = 3  # steps timed before the median counts (the first ones compile, build, warm caches)
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def hang_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / HANGS


class Watchdog:
    """Armed around every step (:meth:`arm`, :meth:`disarm`): a step longer than ``factor`` x the median
    of recent steps (at least ``min_seconds``, or ``limit_seconds``), and never later than 0.8 x the
    collective timeout, makes faulthandler write this rank's stacks once."""

    def __init__(self, cfg: RunConfig, rank: int) -> None:
        self.settings = cfg.train.watchdog
        self.cap = TIMEOUT_SHARE * cfg.parallel.timeout_minutes * 60
        self.path = hang_dir(cfg.run_dir) / f"rank_{rank:05d}.txt"
        self.seconds: deque[float] = deque(maxlen=50)
        self.file = None

    def limit(self) -> float:
        """Seconds the next step may take before this rank's stacks are written."""
        w = self.settings
        if w.limit_seconds is not None:
            return min(w.limit_seconds, self.cap)
        if len(self.seconds) < SETTLED_STEPS:
            return self.cap
        return min(max(w.min_seconds, w.factor * statistics.median(self.seconds)), self.cap)

    def arm(self) -> None:
        if not self.settings.enabled:
            return
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "a")
        faulthandler.dump_traceback_later(self.limit(), repeat=False, file=self.file)

    def disarm(self, seconds: float) -> None:
        """After a step that took ``seconds``."""
        if self.file is not None:
            faulthandler.cancel_dump_traceback_later()
        self.seconds.append(seconds)

    def close(self) -> None:
        """Stop watching; an empty stack file (nothing hung) is removed."""
        if self.file is None:
            return
        faulthandler.cancel_dump_traceback_later()
        self.file.close()
        self.file = None
        if self.path.stat().st_size == 0:
            self.path.unlink()
            try:
                self.path.parent.rmdir()  # (unless another rank's stacks are in it)
            except OSError:
                pass


def stack_dumps(run_dir: str | Path) -> list[Path]:
    """The stack files the watchdogs of a run wrote."""
    return sorted(p for p in hang_dir(run_dir).glob("rank_*.txt") if p.stat().st_size > 0)


def switch_on_flight_recorder(run_dir: str | Path, environ=os.environ) -> None:
    """NCCL's flight recorder (a ring of recent collectives per rank) on, dumped on a collective timeout to
    RUN_DIR/hangs/nccl_trace_rank_N; variables the user set are left as they are. Before the process group
    starts, on CUDA (gloo has no flight recorder)."""
    for name, value in FLIGHT_RECORDER.items():
        environ.setdefault(name, value)
    hang_dir(run_dir).mkdir(parents=True, exist_ok=True)
    environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(hang_dir(run_dir).resolve() / "nccl_trace_rank_"))
