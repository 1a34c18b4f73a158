"""A process group of threads for unit tests of code that runs collectives: each thread a rank, torch.distributed's
object collectives met at a barrier."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist


class ThreadRanks:
    """A process group of ``world`` threads: each thread's rank, and all_gather_object through a barrier."""

    def __init__(self, world: int) -> None:
        self.world, self.local = world, threading.local()
        self.slots: list[object] = [None] * world
        self.barrier = threading.Barrier(world, timeout=30)

    def rank(self) -> int | None:
        """This thread's rank; None outside the ranks."""
        return getattr(self.local, "rank", None)

    def all_gather_object(self, out: list, obj: object, group=None) -> None:
        self.slots[self.rank()] = obj
        self.barrier.wait()
        out[:] = list(self.slots)
        self.barrier.wait()

    def run(self, work) -> list[tuple[object, BaseException | None]]:
        """``work()`` on every rank: each rank's result, or the error it raised."""
        outcomes: list = [None] * self.world

        def rank(r: int) -> None:
            self.local.rank = r
            try:
                outcomes[r] = (work(), None)
            except BaseException as err:
                outcomes[r] = (None, err)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(self.world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        return outcomes


def thread_group(monkeypatch: pytest.MonkeyPatch, world: int) -> ThreadRanks:
    """torch.distributed as ``world`` threads see it (a group running; their ranks; all_gather_object)."""
    group = ThreadRanks(world)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group_=None: group.rank())
    monkeypatch.setattr(dist, "get_world_size", lambda group_=None: world)
    monkeypatch.setattr(dist, "all_gather_object", group.all_gather_object)
    return group
