"""A counter of host reads: every call that makes the host wait for a tensor's value (``Tensor.item``,
``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``) or for the device (``torch.cuda.synchronize``),
with where it was made. On a CPU such a call costs nothing, but on a GPU each one stalls the host until the
device has caught up: counting them on CPU tells which a GPU step would make. ``.numpy()`` of a host tensor (the
loader's batches) is no read of the device and is not counted."""

from __future__ import annotations

import traceback
from contextlib import contextmanager

import torch

READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


class HostReads:
    def __init__(self) -> None:
        self.where: list[str] = []  # one entry per read: the innermost frame outside torch

    @property
    def count(self) -> int:
        return len(self.where)

    def record(self, name: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "/torch/" not in f.filename]
        frame = frames[-1] if frames else None
        self.where.append(f"{name} at {frame.filename}:{frame.lineno}" if frame else name)


@contextmanager
def counting_host_reads():
    """Within the block, every host read is recorded in the yielded :class:`HostReads`."""
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name):
        original = originals[name]

        def read(self, *args, **kwargs):
            reads.record(name)
            return original(self, *args, **kwargs)

        return read

    synchronize = torch.cuda.synchronize

    def synchronized(*args, **kwargs):
        reads.record("torch.cuda.synchronize")
        return synchronize(*args, **kwargs)

    for name in READS:
        setattr(torch.Tensor, name, counted(name))
    torch.cuda.synchronize = synchronized
    try:
        yield reads
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
        torch.cuda.synchronize = synchronize
