"""Gloo CPU ranks for the benchmarks: a script's ranks started as processes, each measured from outside
(:func:`run_ranks`), and a process joining as one of them (:func:`join`), through the trainer's own set-up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
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


@dataclass
class Rank:
    """What a rank wrote (its ``--out`` file, JSON) and what ``/usr/bin/time`` measured of its process."""

    record: dict
    peak_rss_mib: float
    cpu_s: float


def run_ranks(script: str, code: str, ranks: int, work: Path, worker: list[str], passed: list[str]) -> list[Rank]:
    """``ranks`` processes of ``python script --worker RANK PORT *worker --out OUT *passed`` with ``code``'s
    megatransformer (``PYTHONPATH``), one thread each, each under ``/usr/bin/time``; their records, or an exit
    naming the failure."""
    from megatransformer.training.runtime.distributed import free_port

    port = str(free_port())
    env = {**os.environ, "PYTHONPATH": str(Path(code).resolve()), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    processes = [
        subprocess.Popen(
            ["/usr/bin/time", "-f", "%M %U %S", "-o", str(work / f"time.{rank}")]
            + [sys.executable, script, "--worker", str(rank), port, *worker, "--out", str(work / f"rank.{rank}")]
            + passed,
            env=env,
        )
        for rank in range(ranks)
    ]
    if any(p.wait() for p in processes):
        raise SystemExit(f"a rank of {Path(script).name} {' '.join(worker)} with {code} failed")
    measured = []
    for rank in range(ranks):
        rss, user, system = (work / f"time.{rank}").read_text().split()[-3:]
        record = json.loads((work / f"rank.{rank}").read_text())
        measured.append(Rank(record, int(rss) / 1024, float(user) + float(system)))
    return measured
