"""Hang diagnosis: a per-rank watchdog that writes every thread's Python stack of its rank to
RUN_DIR/hangs/rank_NNNNN.txt when a step takes far longer than usual, before parallel.timeout_minutes ends
the run; and, on CUDA, NCCL's flight recorder switched on (docs/spikes.md).

A step only sets or clears a deadline (no system call, no thread per step); a thread looks at it twice a
second and, past it, writes the stacks with faulthandler. It needs the GIL for that, which a rank waiting in
a collective (or in any call that releases the GIL) does not hold.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from megatransformer.config import RunConfig

HANGS = "hangs"
TIMEOUT_SHARE = 0.8  # a dump comes at the latest after this share of parallel.timeout_minutes
SETTLED_STEPS = 3  # steps timed before the median counts (the first ones compile, build, warm caches)
POLL_SECONDS = 0.5
FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}


def hang_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / HANGS


class Watchdog:
    """Armed around every step (:meth:`arm`, :meth:`disarm`): a step longer than ``factor`` x the median
    of recent steps (at least ``min_seconds``, or ``limit_seconds``), and never later than 0.8 x the
    collective timeout, makes it write this rank's stacks once."""

    def __init__(self, cfg: RunConfig, rank: int) -> None:
        self.settings = cfg.train.watchdog
        self.cap = TIMEOUT_SHARE * cfg.parallel.timeout_minutes * 60
        self.path = hang_dir(cfg.run_dir) / f"rank_{rank:05d}.txt"
        self.seconds: deque[float] = deque(maxlen=50)
        self.armed: tuple[float, float, str] | None = None  # (start, deadline, what) of the work under way
        self.closing = threading.Event()
        self.thread: threading.Thread | None = None

    def limit(self) -> float:
        """Seconds the next step may take before this rank's stacks are written."""
        w = self.settings
        if w.limit_seconds is not None:
            return min(w.limit_seconds, self.cap)
        if len(self.seconds) < SETTLED_STEPS:
            return self.cap
        return min(max(w.min_seconds, w.factor * statistics.median(self.seconds)), self.cap)

    def arm(self, limit: float | None = None, what: str = "a step") -> None:
        if not self.settings.enabled:
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._watch, name="megatransformer-watchdog", daemon=True)
            self.thread.start()
        now = time.monotonic()
        self.armed = (now, now + (self.limit() if limit is None else limit), what)

    @contextlib.contextmanager
    def watching(self, what: str, timeout_minutes: float | None = None) -> Iterator[None]:
        """Around collective work that is not a step (a checkpoint, validation): its stacks once it has run for
        0.8 x the collective timeout (``timeout_minutes``: of the groups that work waits on, where not the
        training's), so that a peer stalled there leaves them too."""
        self.arm(self.cap if timeout_minutes is None else TIMEOUT_SHARE * timeout_minutes * 60, what)
        try:
            yield
        finally:
            self.armed = None

    def disarm(self, seconds: float) -> None:
        """After a step that took ``seconds``."""
        self.armed = None
        self.seconds.append(seconds)

    def close(self) -> None:
        if self.thread is not None:
            self.closing.set()
            self.thread.join()
            self.thread = None

    def _watch(self) -> None:
        written = None  # the step whose overrun was written (once per step)
        while not self.closing.wait(POLL_SECONDS):
            armed = self.armed
            if armed is not None and armed != written and time.monotonic() > armed[1]:
                self._write(armed[2], time.monotonic() - armed[0], armed[1] - armed[0])
                written = armed

    def _write(self, what: str, seconds: float, limit: float) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:
            f.write(
                f"{what} has run for {seconds:.1f} s (watchdog limit {limit:.1f} s, "
                f"{time.strftime('%Y-%m-%d %H:%M:%S')}); every thread's stack, most recent call first:\n"
            )
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)


def stack_dumps(run_dir: str | Path) -> list[Path]:
    """The stack files the watchdogs of a run wrote."""
    return sorted(hang_dir(run_dir).glob("rank_*.txt"))


def dump_rank(path: Path) -> int:
    """The rank whose stacks a file of :func:`stack_dumps` holds."""
    return int(path.stem.removeprefix("rank_"))


def switch_on_flight_recorder(run_dir: str | Path, environ=os.environ) -> None:
    """NCCL's flight recorder (a ring of recent collectives per rank) on, dumped on a collective timeout to
    RUN_DIR/hangs/nccl_trace_rank_N; variables the user set are left as they are. Before the process group
    starts, on CUDA (gloo has no flight recorder)."""
    for name, value in FLIGHT_RECORDER.items():
        environ.setdefault(name, value)
    hang_dir(run_dir).mkdir(parents=True, exist_ok=True)
    environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(hang_dir(run_dir).resolve() / "nccl_trace_rank_"))
