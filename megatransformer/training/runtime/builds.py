"""DeepSpeed's ops built on first use (JIT, through ``torch.utils.cpp_extension``): which ones a run builds, a
line before each build and before each wait on another process's build lock, a line a minute while one goes on,
and no build at all where none is needed. Design: docs/first-run.md.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

COLLECTIVE = "deepspeed_shm_comm"  # DeepSpeed's shared-memory all-reduce of a node's CPU ranks
CPU_ADAM = "cpu_adam"  # DeepSpeedCPUAdam, the optimizer step of parallel.offload_optimizer
WHAT = {
    COLLECTIVE: f"DeepSpeed's CPU collective ({COLLECTIVE})",
    CPU_ADAM: f"DeepSpeed's CPU Adam ({CPU_ADAM}, for parallel.offload_optimizer)",
}
BUILD_TIME = "2-4 min on 2 idle cores, 7 or more on a busy machine"


def ops_to_build(world_size: int, cuda: bool, offload_optimizer: bool) -> list[str]:
    """The ops DeepSpeed builds for a run: its CPU collective when CPU ranks share a process group (a world of
    one skips it, :func:`skip_collective_build`), CPU Adam for an offloaded optimizer."""
    ops = [COLLECTIVE] if world_size > 1 and not cuda else []
    return ops + [CPU_ADAM] if offload_optimizer else ops


def build_dir(op: str) -> Path:
    """Where torch builds ``op``: ``$TORCH_EXTENSIONS_DIR/op``, or ``~/.cache/torch_extensions/py311_cpu/op``
    (torch's own rule, which also creates the directory, as its build would)."""
    from torch.utils.cpp_extension import _get_build_directory

    return Path(_get_build_directory(op, verbose=False))


def build_notes(ops: list[str], now: float | None = None) -> list[str]:
    """One line for each op this process will wait for: another process's build (its lock file is there:
    torch waits until it is gone, for ever if that build was killed) or a build of its own (no library yet)."""
    now = time.time() if now is None else now
    lines = []
    for op in ops:
        directory = build_dir(op)
        lock = directory / "lock"
        try:
            age = now - lock.stat().st_mtime
        except FileNotFoundError:
            if not any(directory.glob(f"{op}*.so")):
                lines.append(f"building {WHAT[op]} in {directory}: once per machine, {BUILD_TIME}")
            continue
        lines.append(
            f"waiting for another process's build of {WHAT[op]}: its lock file {lock} is "
            f"{format_age(age)} old; a build takes {BUILD_TIME}, so if no build is running (a killed one "
            "leaves its lock behind), delete that file"
        )
    return lines


@contextlib.contextmanager
def build_progress(ops: list[str], out: TextIO, every: float = 60.0) -> Iterator[None]:
    """While the body runs (DeepSpeed starting, which builds or waits for ``ops``): every ``every`` seconds, a
    line to ``out`` for each op whose build lock is still there, so that a long build or wait is never a
    silent one."""
    if not ops:
        yield
        return
    started = time.monotonic()
    done = threading.Event()

    def report() -> None:
        while not done.wait(every):
            for op in ops:
                lock = build_dir(op) / "lock"
                if lock.exists():
                    waited = format_age(time.monotonic() - started)
                    print(f"still waiting for {WHAT[op]} to build ({waited} so far): lock file {lock}", file=out)
                    out.flush()

    thread = threading.Thread(target=report, name="megatransformer-build-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def format_age(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def skip_collective_build() -> None:
    """Tell DeepSpeed not to build its CPU collective in this process, whose world is one rank: it builds it
    whenever a process group starts on a CPU (2-4 minutes the first time), but uses it only for all-reduces
    across several ranks (``inference_all_reduce`` returns at once for one). DeepSpeed builds only the ops its
    cached compatibility table marks compatible, and that table is meant to be edited in place."""
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__[COLLECTIVE] = False
