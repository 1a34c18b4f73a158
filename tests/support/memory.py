"""The peak host memory a piece of code takes, counted without clocks: torch's CPU allocator's allocations and
frees as the profiler records them (its event tree, in the order they happen) and Python's own (tracemalloc:
bytes, numpy arrays); the two peaks added, an upper bound of the true one. The profiler records this thread's
frees only: :func:`broadcasts_freed_here` keeps a tensor a collective holds from being freed on another."""

from __future__ import annotations

import tracemalloc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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


@contextmanager
def broadcasts_freed_here() -> Iterator[None]:
    """DeepSpeed's broadcasts in it (``deepspeed.comm.broadcast``) hold what they sent until the next one has
    returned, and let it go on this thread. ZeRO-3 frees a parameter's whole tensor just after it broadcasts it
    (``zero.Init`` partitioning a parameter), and gloo's worker thread, which holds it until it is done with it,
    then often drops the last reference: a free the profiler never records, so that the tensor counts as held to
    the end. With this each counts till the next broadcast (an upper bound)."""
    from deepspeed import comm

    broadcast = comm.broadcast
    sent: list = []

    def broadcast_and_hold(tensor, src, group=None, async_op=False, **kwargs):
        work = broadcast(tensor, src, group=group, async_op=True, **kwargs)
        if async_op:
            return work
        work.wait()
        sent[:] = [work]  # (the previous one's tensor let go here)
        return None

    comm.broadcast = broadcast_and_hold
    try:
        yield
    finally:
        comm.broadcast = broadcast
        sent.clear()
