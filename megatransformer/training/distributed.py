"""Process-group set-up: whatever launched us (nothing, torchrun, or Slurm through ``launch``) has put
RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment; DeepSpeed does the rest."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: str  # "cpu" or "cuda:N"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup() -> Dist:
    """Initialise torch.distributed through DeepSpeed (NCCL on GPUs, gloo on CPU)."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "WORLD_SIZE" not in os.environ:  # a plain single process: a world of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(_free_port()))
    if os.environ.get("MASTER_PORT") == "0":  # torchrun --master_port=0 exports 0: every rank would wait forever
        from megatransformer.config import ConfigError

        raise ConfigError("MASTER_PORT=0 cannot be reached by the other ranks; use `torchrun --standalone` "
                          "or pass a free port with --master_port")
    import deepspeed
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    return Dist(dist.get_rank(), dist.get_world_size(), local_rank, f"cuda:{local_rank}" if cuda else "cpu")
