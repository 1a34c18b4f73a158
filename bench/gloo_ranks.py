"""Gloo CPU ranks for the benchmarks: this process joins as rank ``rank`` of ``ranks`` on one machine, one thread,
through the trainer's own set-up."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatransformer.training.runtime.distributed import Dist


def join(rank: int, ranks: int, port: int | str) -> Dist:
    """This process as gloo rank ``rank`` of ``ranks`` (one thread, DeepSpeed's CPU accelerator), set up as the
    trainer sets a rank up."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(ranks),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(ranks),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        DS_ACCELERATOR="cpu",
    )
    import torch

    torch.set_num_threads(1)
    from megatransformer.training.runtime.distributed import setup

    return setup()
