"""Exact resume on two data-parallel ranks (ZeRO-2, gradient accumulation, periodic validation).

The ranks are spawned directly with RANK / WORLD_SIZE / MASTER_* in their environment (as srun does), so
each rank's exit code and pid are ours: the run is killed with SIGKILL on every rank at an arbitrary step,
resumed, preempted with SIGUSR1 sent to one rank only (both ranks must checkpoint and exit 124), resumed
again, and its metrics.jsonl must equal an uninterrupted run's line by line.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

STEPS = 14
EXACT = ("step", "loss", "lr", "grad_norm", "tokens", "val_loss", "val_tokens", "bad_steps")


def overrides(tiny_data, run_dir: Path) -> list[str]:
    return ["model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", "model.d_ff=64",
            "model.vocab_size=512", "model.max_seq_len=32", f"run_dir={run_dir}", f"data.train={tiny_data.shards}",
            f"data.tokenizer={tiny_data.tokenizer}", "data.seq_len=32", "train.micro_batch_size=2",
            "train.grad_accum=2", f"train.max_steps={STEPS}", "train.log_every=1", "train.eval_every=5",
            "train.eval_batches=1", "optim.lr=1e-2", "schedule.warmup_steps=2", "checkpoint.every=3",
            "checkpoint.keep=2", "parallel.zero_stage=2", "wandb.mode=disabled", "resume=auto"]


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def spawn(args: list[str], log: Path, world: int = 2) -> list[subprocess.Popen]:
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port}
        out = open(f"{log}.rank{rank}.log", "a")
        procs.append(subprocess.Popen([sys.executable, "-m", "megatransformer.cli", "train", "--config", os.devnull,
                                       *args], env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def wait(procs: list[subprocess.Popen], log: Path, timeout: float = 300) -> list[int]:
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"ranks did not finish in {timeout} s; see {log}.rank*.log") from None


def wait_for_step(run_dir: Path, step: int, procs: list[subprocess.Popen], timeout: float = 300) -> None:
    path, deadline = run_dir / "metrics.jsonl", time.time() + timeout
    while time.time() < deadline:
        if path.is_file() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines()):
            return
        assert all(p.poll() is None for p in procs), f"a rank ended before step {step}"
        time.sleep(0.02)
    raise AssertionError(f"step {step} not reached in {timeout} s")


def records(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(line).items() if k in EXACT} for line in lines]


def test_kill_9_then_preemption_then_resume_equals_uninterrupted(tiny_data, tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "interrupted"
    assert wait(spawn(overrides(tiny_data, reference), reference), reference) == [0, 0]

    procs = spawn(overrides(tiny_data, run), run)  # 1. killed -9 on every rank, between checkpoints
    wait_for_step(run, 5, procs)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    wait(procs, run)
    killed_at = max(r["step"] for r in records(run))
    latest = int((run / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert latest % 3 == 0 and 3 <= latest <= killed_at  # a save cut short by the kill is not `latest`

    procs = spawn(overrides(tiny_data, run), run)  # 2. resumed, then preempted through one rank only
    wait_for_step(run, killed_at + 2, procs)
    procs[1].send_signal(signal.SIGUSR1)
    assert wait(procs, run) == [124, 124]
    preempted_at = (run / "checkpoints" / "latest").read_text()
    assert killed_at < int(preempted_at.removeprefix("step_")) < STEPS

    assert wait(spawn(overrides(tiny_data, run), run), run) == [0, 0]  # 3. resumed to the end
    assert records(run) == records(reference)
    assert (run / "checkpoints" / "latest").read_text() == f"step_{STEPS:06d}"
    assert len(list((run / "checkpoints").glob("step_*"))) == 2  # checkpoint.keep
