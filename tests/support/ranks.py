"""The ranks of an in-process test (a function run as each gloo rank), forked from a server that has imported torch,
dynamo, DeepSpeed and the trainer once: ``torch.multiprocessing.spawn`` starts each rank from a fresh interpreter,
which imports them again (~4.5 s of CPU a rank)."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable

import torch.multiprocessing as mp

# what a rank imports before its process group starts (dynamo first, as the trainer's set-up has it)
PRELOAD = ["torch", "torch._dynamo", "deepspeed", "megatransformer.training.engine.train_module"]


def fork_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes forked from the fork server, joined; an error if one fails, as
    ``torch.multiprocessing.spawn``. CPU ranks only: the server runs with the environment it started with (the
    ranks set their own process-group variables) and must never touch CUDA, since it forks."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # (DeepSpeed picks its accelerator as the server imports it)
    multiprocessing.set_forkserver_preload(PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
