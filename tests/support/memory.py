"""The peak host memory a piece of code takes, counted without clocks: torch's CPU allocator's allocations and
frees as the profiler records them (its event tree, in the order they happen) and Python's own (tracemalloc:
bytes, numpy arrays); the two peaks added, an upper bound of the true one. The profiler records this thread's
frees only: a tensor a collective's worker thread frees last counts as held to the end."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable
from typing import Any

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def peak_host_bytes(run: Callable[[], Any], python: bool = True) -> int:
    """The most host memory ``run()`` holds at once beyond what was held before it (what it returns counts);
    ``python`` False: torch's tensors only."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        tracemalloc.start()
        try:
            kept = run()
            _, python_peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    del kept
    changes: list[tuple[int, int]] = []
    nodes = list(prof.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == "cpu":
            changes.append((node.start_time_ns, node.extra_fields.alloc_size))
        nodes.extend(node.children)
    live = torch_peak = 0
    for _, change in sorted(changes):
        live += change
        torch_peak = max(torch_peak, live)
    return torch_peak + (python_peak if python else 0)
