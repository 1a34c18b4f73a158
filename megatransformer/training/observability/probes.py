"""Probes for what a training step asks of the host: host syncs, and where collectives' tensors live.

On a GPU every value the host reads from the device (``.item()``, ``bool(t)``, ``nonzero``, ``tolist`` ...)
waits for all queued work; a step that does so per layer or per micro batch leaves the GPU idle. A collective
on a tensor that is not on the run's device fails on NCCL (or silently goes through the host on gloo).
:class:`HostSyncCounter` counts the first while code runs (the reads our code asks for, on any device);
:class:`CudaSyncCounter` counts every wait CUDA sees; :class:`CollectiveDevices` records the second.
The tests and ``bench/gpu_check.py`` wrap :meth:`engine.TrainModule.step` in them, and a step whose result is
left to read (:meth:`engine.TrainModule.advance`).
"""

from __future__ import annotations

import sys
import traceback
import warnings
from collections import Counter
from contextlib import ExitStack, nullcontext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

# operators whose result (a value or a shape) the host must read from the device
SYNCING_OPS = {
    aten._local_scalar_dense,
    aten.nonzero,
    aten.masked_select,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.equal,
    aten.is_nonzero,
}
# tensor methods that read values without an operator the dispatcher sees (on CPU tensors)
SYNCING_METHODS = {torch.Tensor.tolist}

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "reduce",
    "all_to_all_single",
)


class _DispatchCounter(TorchDispatchMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in SYNCING_OPS:
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _MethodCounter(TorchFunctionMode):
    def __init__(self, counts: Counter) -> None:
        super().__init__()
        self.counts = counts

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in SYNCING_METHODS:
            self.counts[func.__name__] += 1
        return func(*args, **(kwargs or {}))


class HostSyncCounter:
    """Counts host syncs of the code run inside ``with HostSyncCounter() as syncs:``; ``syncs.total``."""

    def __init__(self) -> None:
        self.counts: Counter = Counter()
        self._stack = ExitStack()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> HostSyncCounter:
        self._stack.enter_context(_MethodCounter(self.counts))
        self._stack.enter_context(_DispatchCounter(self.counts))
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()


class CudaSyncCounter:
    """Counts the waits for the GPU inside the block as CUDA itself sees them (``torch.cuda`` sync debug mode:
    device-to-host copies and explicit synchronisations too, DeepSpeed's included); ``syncs.total``, and
    ``syncs.sites``: the Python line that asked for each (the innermost frame outside torch and this module)."""

    MESSAGE = "called a synchronizing CUDA operation"  # the warning each synchronising call raises

    def __init__(self) -> None:
        self.total = 0
        self.sites: Counter = Counter()  # "package/module.py:line" -> waits
        self._warnings = warnings.catch_warnings()

    def __enter__(self) -> CudaSyncCounter:
        self._warnings.__enter__()
        warnings.simplefilter("always")
        self._show, warnings.showwarning = warnings.showwarning, self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def _record(self, message, category, filename, lineno, file=None, line=None) -> None:
        if self.MESSAGE not in str(message):
            return self._show(message, category, filename, lineno, file, line)
        self.total += 1
        self.sites[_caller_outside(_TORCH, Path(__file__))] += 1

    def __exit__(self, *exc: Any) -> None:
        torch.cuda.set_sync_debug_mode("default")
        self._warnings.__exit__(*exc)


_TORCH = Path(torch.__file__).parent


def _caller_outside(*excluded: Path) -> str:
    """``package/module.py:line`` of the innermost Python frame whose file lies outside ``excluded`` (files or
    directories) and the warnings machinery; the path as imported (``deepspeed/runtime/utils.py``)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if path.name != "warnings.py" and not any(path.is_relative_to(d) for d in excluded):
            return f"{_import_path(path)}:{frame.lineno}"
    return "?"


def _import_path(path: Path) -> str:
    """``path`` relative to the deepest ``sys.path`` entry holding it (the path itself where none does)."""
    roots = [Path(entry or ".").resolve() for entry in sys.path]
    holding = [root for root in roots if path.is_relative_to(root)]
    return str(path.relative_to(max(holding, key=lambda r: len(r.parts)))) if holding else str(path)


class CollectiveDevices:
    """Records the device of every tensor handed to a ``torch.distributed`` collective inside the block
    (DeepSpeed's communication goes through the same functions)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []  # (collective, device)
        self._saved: dict[str, Any] = {}

    def devices(self) -> set[str]:
        return {device for _, device in self.calls}

    def __enter__(self) -> CollectiveDevices:
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self._saved[name] = original
            setattr(dist, name, self._recording(name, original))
        return self

    def _recording(self, name: str, original):
        def collective(*args, **kwargs):
            for value in (*args, *kwargs.values()):
                for tensor in value if isinstance(value, (list, tuple)) else (value,):
                    if isinstance(tensor, torch.Tensor):
                        self.calls.append((name, str(tensor.device)))
            return original(*args, **kwargs)

        return collective

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def probe_step(module, batches, warmup: int = 2) -> dict[str, Any]:
    """Run ``warmup`` steps of a :class:`engine.TrainModule` (ZeRO-3 traces its parameter fetches in its first
    steps), then one under the probes: its host syncs (by
    operator), the devices its collectives used and, on CUDA, the waits CUDA itself counts."""
    for _ in range(warmup):
        module.step(batches)
    cuda_syncs = CudaSyncCounter() if module.device.type == "cuda" else None
    with HostSyncCounter() as syncs, CollectiveDevices() as collectives, cuda_syncs or nullcontext():
        result = module.step(batches)
    # a step whose result is left to read (one that logs nothing), after another: it reads the other's result
    # from its staged copy, and nothing of its own
    module.advance(batches, read=False)
    with HostSyncCounter() as left_to_read:
        module.advance(batches, read=False)
    module.settle()
    return {
        "host_syncs": syncs.total,
        "left_to_read_host_syncs": left_to_read.total,
        "by_op": dict(syncs.counts),
        "collectives": len(collectives.calls),
        "collective_devices": sorted(collectives.devices()),
        "loss": result.loss,
        "cuda_syncs": None if cuda_syncs is None else cuda_syncs.total,
        "cuda_sync_sites": None if cuda_syncs is None else dict(cuda_syncs.sites),
    }
