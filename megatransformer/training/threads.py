"""Intra-op threads for a process that shares its machine (every command that computes): as many as the cores it
may use and that other work leaves it, and OpenMP's idle threads sleeping instead of spinning (set before torch
loads libgomp). docs/first-run.md (threads on a busy machine) describes why."""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from pathlib import Path

CGROUP = Path("/sys/fs/cgroup")
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")  # a user's choice of how OpenMP's idle threads wait
_passive_set = False  # whether set_wait_policy set OMP_WAIT_POLICY=PASSIVE in this process


def usable_cores(cgroup: Path = CGROUP) -> float:
    """The cores this process may run on (its CPU affinity), capped by its cgroup's CPU quota (v2 ``cpu.max``,
    v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) where one is set."""
    cores = float(len(os.sched_getaffinity(0)))
    return min(cores, cgroup_quota(cgroup) or cores)


def cgroup_quota(cgroup: Path = CGROUP) -> float | None:
    """The cgroup's CPU quota in cores, or None when there is none (or none can be read)."""
    try:
        if (cgroup / "cpu.max").is_file():
            quota, period = (cgroup / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = cgroup / "cpu"
        quota = int((v1 / "cpu.cfs_quota_us").read_text())
        return None if quota <= 0 else quota / int((v1 / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None


def other_load(readings: int = 9, interval: float = 0.02) -> float:
    """Runnable tasks of other work now: the median of a few readings of /proc/loadavg's running count, less this
    process. (The 1-minute load average remembers the last minute, this process's own work and a run that just
    ended included; it is the answer only where there is no /proc.)"""
    counts = []
    for _ in range(readings):
        try:
            running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
        except (OSError, ValueError, IndexError):
            return os.getloadavg()[0]
        counts.append(max(0, running - 1))
        time.sleep(interval)
    return float(statistics.median(counts))


def pick_threads(cores: float, load: float, processes: int = 1) -> int:
    """Intra-op threads for each of ``processes`` processes of a run on ``cores`` usable cores with ``load``
    runnable tasks of other work (:func:`other_load`): the cores left free, at least 1."""
    free = (cores - load) / processes
    return max(1, min(math.floor(cores / processes), math.floor(free + 0.5)))


def set_wait_policy(environ: dict[str, str] | None = None, load: float | None = None) -> bool:
    """Before torch is imported (libgomp reads its settings once, when it loads): OMP_WAIT_POLICY=PASSIVE when
    other work takes cores from this process (``load``: :func:`other_load`'s), so that OpenMP's idle threads
    sleep at once instead of spinning for milliseconds after each parallel region while the thread they wait
    for is preempted. Left alone: a user's OMP_WAIT_POLICY or GOMP_SPINCOUNT, a quiet machine, and a process
    that has imported torch already. Subprocesses (torchrun's ranks, DataLoader workers) inherit it. Whether
    it set it."""
    global _passive_set
    environ = os.environ if environ is None else environ
    if any(name in environ for name in WAIT_VARIABLES) or (environ is os.environ and "torch" in sys.modules):
        return False
    cores = usable_cores()
    processes = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    load = other_load() if load is None else load
    if pick_threads(cores, load, processes) >= max(1, math.floor(cores / processes)):
        return False
    environ["OMP_WAIT_POLICY"] = "PASSIVE"
    _passive_set = environ is os.environ
    return True


def set_threads_for_machine(environ: dict[str, str] | None = None) -> str | None:
    """Unless OMP_NUM_THREADS chooses, set this process's intra-op threads from what the machine gives it;
    a line to print when other work takes cores from it (None otherwise)."""
    environ = os.environ if environ is None else environ
    if "OMP_NUM_THREADS" in environ:  # (torchrun sets 1 per rank)
        return None
    import torch

    cores, load = usable_cores(), other_load()
    processes = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = pick_threads(cores, load, processes)
    default = torch.get_num_threads()
    torch.set_num_threads(threads)
    if threads >= min(default, math.floor(cores / processes)):
        return None
    passive = ", idle OpenMP threads sleep (OMP_WAIT_POLICY=PASSIVE)" if _passive_set else ""
    return (
        f"busy machine: load {load:.1f} on the {cores:g} cores this process may use: {threads} intra-op "
        f"thread{'s' * (threads != 1)} instead of {default}{passive} (threads that wait for cores slow every step; "
        "OMP_NUM_THREADS=N chooses)"
    )


def say_threads(say) -> None:
    """:func:`set_threads_for_machine` for a command other than train, its line (if any) through ``say``."""
    line = set_threads_for_machine()
    if line and os.environ.get("RANK", "0") == "0":
        say(line)
