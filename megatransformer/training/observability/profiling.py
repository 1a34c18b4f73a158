"""Where a step's time goes: torch.profiler over a window of steps (``train.profile``), each rank's operators by
the time they took on file when the window closes (:class:`StepProfiler`, :func:`write_profile`)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from megatransformer.config import ProfileConfig

TOP_ROWS = 40  # operators kept in each rank's table and JSON


class StepProfiler:
    """Opens torch.profiler before the window's first step and closes it after its last, then writes this rank's
    files (:func:`write_profile`); a window starting at 0 does nothing. A run that ends inside the window writes
    what it profiled (:meth:`close`). The profile is a diagnosis, not the run: should the profiler fail, the line
    says so and training goes on."""

    def __init__(self, window: ProfileConfig, run_dir: str | Path, rank: int, device: torch.device) -> None:
        self.first, self.last = window.start, window.start + window.steps - 1
        self.folder, self.rank, self.device = Path(run_dir) / "profile", rank, device
        self.profiler: profile | None = None
        self.opened_at = 0.0
        self.steps = 0

    def step_starts(self, step: int) -> str | None:
        """Opens the window at its first step; returns the log line then."""
        if self.first == 0 or step != self.first:
            return None
        try:
            self.profiler = profile(activities=activities(self.device.type))
            self.profiler.start()
        except Exception as err:  # noqa: BLE001 (said in the line; the run goes on)
            self.profiler = None
            return f"train.profile: torch.profiler did not start ({type(err).__name__}: {err}); training goes on"
        self.opened_at = time.perf_counter()
        return f"profiling steps {self.first}-{self.last} (train.profile)"

    @property
    def recording(self) -> bool:
        return self.profiler is not None

    def step_ended(self, step: int) -> str | None:
        """Counts the step; after the window's last, closes it and returns the log line naming the files."""
        if self.profiler is None:
            return None
        self.steps += 1
        return self.close() if step == self.last else None

    def close(self) -> str | None:
        """Closes an open window and writes its files; returns the log line (None when none was open)."""
        if self.profiler is None:
            return None
        if self.device.type == "cuda":  # (the window's kernels finish inside it)
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - self.opened_at
        profiler, self.profiler = self.profiler, None
        try:
            profiler.stop()
            summary = write_profile(profiler, self.steps, seconds, self.folder, self.rank, self.device.type)
        except Exception as err:  # noqa: BLE001 (said in the line; the run goes on)
            return f"train.profile: the profile of {self.steps} step(s) was not written ({type(err).__name__}: {err})"
        busy = summary.get("device_busy_ms")
        on_device = "" if busy is None else f", kernels {busy:.1f} ms of it"
        return (
            f"profile of {self.steps} step(s): {summary['step_ms']:.1f} ms a step{on_device}; "
            f"{self.folder}/rank_{self.rank:05d}.txt and .json"
        )


def activities(device_type: str) -> list[ProfilerActivity]:
    """What the profiler records on ``device_type``: the host's operators, and a GPU's kernels and copies."""
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device_type == "cuda" else [])


def kernel_seconds(prof: profile) -> float:
    """The device kernels' time, summed (the device's busy time where kernels do not overlap)."""
    kernels = (event for event in prof.events() if event.device_type == DeviceType.CUDA)
    return sum(event.time_range.elapsed_us() for event in kernels) / 1e6


def write_profile(prof: profile, steps: int, seconds: float, folder: Path, rank: int, device_type: str) -> dict:
    """``rank_NNNNN.txt`` (torch's table of the top operators) and ``rank_NNNNN.json`` in ``folder``: per step,
    the wall time, the kernels' time on a GPU (:func:`kernel_seconds`) and the top operators' calls and self/total
    CPU and device microseconds (an operator's device time repeats its kernels'), sorted by self device time on a
    GPU, self CPU time elsewhere. Returns the JSON's content."""
    cuda = device_type == "cuda"
    sort = "self_device_time_total" if cuda else "self_cpu_time_total"
    averages = prof.key_averages()
    rows = sorted(averages, key=lambda row: getattr(row, sort), reverse=True)
    per_step = max(steps, 1)

    def row(event) -> dict:
        return {
            "name": event.key,
            "on": event.device_type.name.lower(),  # cpu: an operator; cuda: a kernel or a copy
            "calls": event.count / per_step,
            "self_cpu_us": event.self_cpu_time_total / per_step,
            "cpu_us": event.cpu_time_total / per_step,
            "self_device_us": event.self_device_time_total / per_step,
            "device_us": event.device_time_total / per_step,
        }

    summary = {
        "steps": steps,
        "step_ms": 1e3 * seconds / per_step,
        "device_busy_ms": kernel_seconds(prof) * 1e3 / per_step if cuda else None,
        "sorted_by": sort,
        "top": [row(event) for event in rows[:TOP_ROWS]],
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank_{rank:05d}.txt").write_text(averages.table(sort_by=sort, row_limit=TOP_ROWS) + "\n")
    (folder / f"rank_{rank:05d}.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary
