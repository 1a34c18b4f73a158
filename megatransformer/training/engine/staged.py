"""A small device tensor's value brought to the host without making the host wait: the copy is queued behind
the work that computes it and waited for only when the value is asked, a step later, when the device is long
past it (on CUDA: a non-blocking copy into page-locked memory and an event; a CPU has computed the value before
the host goes on, so there it is the tensor itself)."""

from __future__ import annotations

import torch


class StagedCopy:
    """One page-locked host buffer for the copies of a small tensor; a copy is read before the next is queued."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def stage(self, tensor: torch.Tensor) -> StagedValue:
        """Queue the copy of ``tensor`` to the host; its values come from :meth:`StagedValue.values`."""
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return StagedValue(tensor, None)
        if self.buffer is None or self.buffer.shape != tensor.shape or self.buffer.dtype != tensor.dtype:
            self.buffer = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self.buffer.copy_(tensor, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return StagedValue(self.buffer, done)


class StagedValue:
    """A staged copy: ``host`` holds the value once ``done`` (a CUDA event; None: at once) has passed."""

    def __init__(self, host: torch.Tensor, done: torch.cuda.Event | None) -> None:
        self.host, self.done = host, done

    def values(self) -> list[float]:
        """The values, waiting for the copy if it is still under way (a step after it was queued, it is not)."""
        if self.done is not None:
            self.done.synchronize()
        return self.host.numpy().tolist()
