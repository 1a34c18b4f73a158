"""Python's garbage collector in training: frozen after start-up and run every ``train.gc_every`` steps, on every
rank at the same step, instead of whenever allocations happen to trigger it (torchtitan and OLMo-core do the
same): a collection inside a step stalls that rank, and with it every rank that waits for it in a collective."""

from __future__ import annotations

import gc


class GarbageCollection:
    """``every`` > 0: freeze what start-up allocated (the collector no longer walks it), turn automatic collection
    off, and collect at each ``every``-th step; 0: Python's own schedule, untouched."""

    def __init__(self, every: int) -> None:
        self.every = every
        if every:
            gc.collect()
            gc.freeze()
            gc.disable()

    def step(self, step: int) -> None:
        """After step ``step``: a full collection when it is due (the objects frozen at start-up are not walked)."""
        if self.every and step % self.every == 0:
            gc.collect()

    def close(self) -> None:
        """Python's own schedule again (the run is over)."""
        if self.every:
            gc.enable()
            gc.unfreeze()
