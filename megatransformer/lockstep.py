"""Ranks that run an evaluation's or a generation's forwards together: each rank's share, every forward voted on
(ZeRO-3 gathers each layer from every rank, so no rank may skip one), the answers gathered on a group of their own,
and one rank's decisions taken by all (docs/evaluation.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

EVAL_GATHER_TIMEOUT_MINUTES = 180.0
"""How long a rank waits for the others' answers (the slowest rank's share of a task): the evaluation's own group,
not the training collectives' parallel.timeout_minutes, which a long evaluation would trip."""


@dataclass(frozen=True)
class Placement:
    """Where an evaluation runs: share ``rank`` of ``world_size`` shares of the items (tensor-parallel peers take
    the same share: the same forwards, each summing their parts), on ``device``; ``forwards``: the context every
    forward runs in (autocast, a run's matmul precision); ``group``: the process group the ranks' answers are
    gathered on (:func:`gather_group`; None: the default one); ``gather``: instead, a function from this rank's
    object to every rank's (tests). ``lockstep`` (several ranks, ``group`` every one): every rank runs each forward
    with the others (ZeRO-3: a forward gathers each layer's parameters from every rank; tensor parallelism: peers sum
    their parts, and should one stop alone the other would wait in the forward's sum), a rank whose share is done
    running stand-in forwards until every share is (:meth:`any_working`, :meth:`wait_for_others`). ``stop``: whether
    this rank was asked to stop (a preemption): the evaluation then ends, on every rank, with :class:`Interrupted`."""

    device: torch.device
    rank: int = 0
    world_size: int = 1
    forwards: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext
    group: object | None = None
    gather: Callable[[object], list] | None = None
    lockstep: bool = False
    stop: Callable[[], bool] | None = None

    def any_working(self, working: bool) -> bool:
        """Before each forward. With ``lockstep`` on several ranks: whether any rank still has a forward of its
        share to run (every rank asks, the same number of times), and :class:`Interrupted` on every rank at once
        should one be asked to stop; otherwise True, or Interrupted on this rank (the gather that follows tells
        the others)."""
        stopping = self.stop is not None and self.stop()
        if not self.lockstep:
            if stopping:
                raise Interrupted
            return True
        flags = torch.tensor([int(working), int(stopping)])
        torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=self.group)
        if flags[1]:
            raise Interrupted
        return bool(flags[0])

    def wait_for_others(self, stand_in: Callable[[], object]) -> None:
        """Once this rank's share is done: in lockstep, ``stand_in`` (a forward through the modules the share's
        forwards run, its answer thrown away) while another rank's share is not."""
        while self.lockstep and self.any_working(False):
            stand_in()

    def gather_all(self, obj: object) -> list:
        """Every rank's ``obj``, in rank order (of the group's ranks: tensor-parallel peers each give theirs)."""
        if self.world_size == 1:
            return [obj]
        if self.gather is not None:
            return self.gather(obj)
        out: list = [None] * torch.distributed.get_world_size(self.group)
        torch.distributed.all_gather_object(out, obj, group=self.group)
        return out


class Interrupted(Exception):
    """The evaluation ended early on every rank: a rank was asked to stop (:attr:`Placement.stop`)."""


def gather_group(world_size: int):
    """A gloo group of every rank, with :data:`EVAL_GATHER_TIMEOUT_MINUTES` (None on one rank). Every rank calls
    it, at the same point."""
    if world_size == 1:
        return None
    import datetime

    timeout = datetime.timedelta(minutes=EVAL_GATHER_TIMEOUT_MINUTES)
    return torch.distributed.new_group(backend="gloo", timeout=timeout)


@contextlib.contextmanager
def joined(device: torch.device, world_size: int) -> Iterator[None]:
    """torchrun's ranks in one process group (NCCL on a GPU, gloo on the CPU), this rank's GPU set as the current
    one, ended on the way out; nothing on one process."""
    if world_size == 1:
        yield
        return
    from megatransformer.training.runtime.distributed import note_group_started, quiet_deprecated_collectives

    quiet_deprecated_collectives()  # (ZeRO-3's gathers)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo")
    note_group_started()
    try:
        yield
    finally:
        torch.distributed.destroy_process_group()


def rank_0s(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as rank 0 holds it, on every rank (in place, on the default group)."""
    torch.distributed.broadcast(tensor, src=0)
    return tensor
