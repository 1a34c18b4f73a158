"""Faults outside the run's control do not kill it or hang it: an unreachable W&B server (the run goes on,
logging offline), a stalled rank (the others exit non-zero after parallel.timeout_minutes, with one line
naming the collective that timed out) and a dead one (at once, one line). Real `megatransformer train`
processes, torchrun for two ranks, or started as srun starts them."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
from support.runs import (
    metrics,
    spawn_ranks,
    tiny_data_overrides,
    tiny_model,
    train,
    train_command,
    wait_for_step,
    wait_ranks,
)

from megatransformer.training.runtime.distributed import EXIT_COLLECTIVE_FAILED

TINY = [
    *tiny_model(),
    "data.seq_len=64",
    "train.micro_batch_size=4",
    "train.grad_accum=1",
    "train.log_every=1",
    "train.eval_batches=2",
]
FAKE_KEY = "0123456789abcdef0123456789abcdef01234567"  # 40 characters, like a real W&B API key


def overrides(tiny_data, run_dir: Path, *extra: str) -> list[str]:
    return [*tiny_data_overrides(tiny_data), *TINY, f"run_dir={run_dir}", *extra]


def test_unreachable_wandb_server_falls_back_to_offline_logging(tiny_data, tmp_path):
    run = tmp_path / "run"
    with socket.socket() as closed:  # bound, never listening: connections to it are refused
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
        # WANDB_INIT_TIMEOUT bounds W&B's retries (its default is 90 s); no wandb.mode: the key makes it online
        env = {
            "WANDB_BASE_URL": f"http://127.0.0.1:{port}",
            "WANDB_API_KEY": FAKE_KEY,
            "WANDB_INIT_TIMEOUT": "5",
            "DS_ACCELERATOR": "cpu",
        }
        result = train(overrides(tiny_data, run, "train.max_steps=3"), expect=None, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    warnings = [line for line in result.stderr.splitlines() if "W&B" in line or "wandb" in line.lower()]
    assert len(warnings) == 1 and "cannot reach the W&B server" in warnings[0] and "wandb sync" in warnings[0], (
        result.stderr[-3000:]
    )
    assert "Traceback" not in result.stderr
    steps = [record["step"] for record in metrics(run)]
    assert steps[-1] == 3
    (offline,) = (run / "wandb").glob("offline-run-*")
    (records,) = offline.glob("run-*.wandb")
    assert b"tokens_per_s" in records.read_bytes()  # the metrics went to the offline run, for `wandb sync`
    for path in run.rglob("*"):
        if path.is_file():
            assert FAKE_KEY.encode() not in path.read_bytes(), path


def _rank_processes(launcher: subprocess.Popen) -> dict[int, psutil.Process]:
    ranks = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            rank = child.environ().get("RANK")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if rank is not None:
            ranks[int(rank)] = child
    return ranks


def test_stalled_rank_makes_the_other_exit_naming_the_timed_out_collective(tiny_data, tmp_path):
    run = tmp_path / "run"
    # 0.25 min: long enough for any rank-0-only work between two collectives on a loaded machine (no
    # checkpoint or evaluation before max_steps, no W&B), short enough for a test
    log = (tmp_path / "stderr.log").open("w")  # (a pipe nobody reads while waiting would fill and block)
    launcher = subprocess.Popen(
        [
            *train_command(nproc=2),
            *overrides(
                tiny_data, run, "train.max_steps=100000", "parallel.timeout_minutes=0.25", "wandb.mode=disabled"
            ),
        ],
        stdout=subprocess.DEVNULL,
        stderr=log,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        start_new_session=True,
    )
    ranks: dict[int, psutil.Process] = {}
    try:
        # until rank 0 has logged step 2 (training under way on both ranks): a start-up on a loaded machine may
        # take long, and the test only judges what happens after a rank stalls mid-training
        wait_for_step(run, 2, [launcher], tmp_path / "stderr.log")
        ranks = _rank_processes(launcher)
        assert sorted(ranks) == [0, 1]
        ranks[1].send_signal(signal.SIGSTOP)
        # rank 0 must give up by itself; the guard only keeps a broken build from hanging the suite
        ranks[0].wait(timeout=300)
        ranks[1].kill()  # (torchrun's SIGTERM waits for a stopped process to continue)
        launcher.wait(timeout=120)
    finally:
        for process in ranks.values():
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        if launcher.poll() is None:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        log.close()
    stderr = (tmp_path / "stderr.log").read_text()
    assert launcher.returncode != 0
    lines = [line for line in stderr.splitlines() if "megatransformer train: error:" in line]
    assert len(lines) == 1, stderr[-3000:]  # rank 0 only: rank 1 was stopped, then killed
    assert "rank 0:" in lines[0] and "timed out" in lines[0] and "parallel.timeout_minutes=0.25" in lines[0]
    # the collective rank 0 waits in depends on where rank 1 stopped (ours, or ZeRO's gathers in the step)
    assert re.search(r"rank 0: (all_\w+|broadcast\w*|barrier|reduce\w*) in \w+ \(\w+\.py:\d+\)", lines[0]), lines[0]
    assert "[rank" not in stderr  # no traceback from a rank: torchrun's report of the failure is the only one
    assert stderr.count("Traceback") == 1 and "raise ChildFailedError" in stderr
    assert "exitcode  : 4" in stderr  # torchrun's summary: rank 0 exited with EXIT_COLLECTIVE_FAILED


def test_a_dead_zero3_rank_makes_the_other_exit_at_once_with_one_line(tiny_data, tmp_path):
    """Ranks as srun starts them (no torchrun to end the others): rank 1 killed mid-run; rank 0, waiting in a
    gather of ZeRO-3's (DeepSpeed waits on its handles itself) or in another collective, ends with one line
    naming rank 1's process and EXIT_COLLECTIVE_FAILED, long before any timeout, not with a traceback."""
    run, log = tmp_path / "run", tmp_path / "train"
    extra = ("train.max_steps=100000", "parallel.zero_stage=3", "wandb.mode=disabled")
    ranks = spawn_ranks(overrides(tiny_data, run, *extra), log)
    try:
        wait_for_step(run, 3, ranks, Path(f"{log}.rank0.log"))
        ranks[1].kill()
        code = wait_ranks(ranks[:1], log, timeout=120)[0]  # (parallel.timeout_minutes: the default 30)
    finally:
        for rank in ranks:
            rank.kill()
    said = Path(f"{log}.rank0.log").read_text()
    assert code == EXIT_COLLECTIVE_FAILED, said[-3000:]
    assert "Traceback" not in said, said[-3000:]
    line = next(line for line in said.splitlines() if "megatransformer train: error: rank 0:" in line)
    assert "GLHF" not in line  # (gloo's advice after the reason is left out)
    # which rank, and that it said nothing: its process is gone (under NCCL, which does not notice, the board's
    # watcher says it); after gloo's reason for the collective (closed, reset), or first should the watcher's poll be
    gone = f"its process ended without a line (pid {ranks[1].pid} on {os.uname().nodename}: killed, "
    assert re.search(r"failed: another rank is gone \(.+\); rank 1 failed first: ", line) or re.search(
        r"rank 0: ending: rank 1 failed: ", line
    ), line
    assert gone in line, line


# megatransformer train whose rank 1 finds a damaged batch at step 4 (a real DataError, raised where the step reads)
RANK_1_FAILS_AT_STEP_4 = """
import os, sys
from data_pipeline import DataError
from megatransformer.cli import main
from megatransformer.training.engine import train_module
advance = train_module.TrainModule.advance
def advance_or_fail(self, batches, stop, spikes, save_due, index, read_now):
    if os.environ["RANK"] == "1" and index == 4:
        raise DataError("train-000003.tar: a damaged sample")
    return advance(self, batches, stop, spikes, save_due, index, read_now)
train_module.TrainModule.advance = advance_or_fail
sys.exit(main(sys.argv[1:]))
"""


def test_a_rank_that_fails_tells_the_others_which_end_naming_it(tiny_data, tmp_path):
    """Ranks as srun starts them: rank 1 stops with an error of its own; rank 0 ends at once naming rank 1's error
    (posted on the job's store before rank 1 closed its connections), not only "another rank is gone"."""
    run, log, script = tmp_path / "run", tmp_path / "train", tmp_path / "fails.py"
    script.write_text(RANK_1_FAILS_AT_STEP_4)
    ranks = spawn_ranks(
        overrides(tiny_data, run, "train.max_steps=100000", "wandb.mode=disabled"),
        log,
        command=[sys.executable, str(script), *train_command()[3:]],
    )
    codes = wait_ranks(ranks, log, timeout=300)
    said = [Path(f"{log}.rank{rank}.log").read_text() for rank in (0, 1)]
    assert codes == [EXIT_COLLECTIVE_FAILED, 2], said[0][-3000:]
    assert "megatransformer train: error: train-000003.tar: a damaged sample" in said[1]
    line = next(line for line in said[0].splitlines() if "megatransformer train: error: rank 0:" in line)
    # (its collective's error naming the first failure, or, had its next read of the board come first, the board's)
    assert re.search(r"rank 1 failed( first)?: train-000003\.tar: a damaged sample$", line), line
    assert "Traceback" not in said[0], said[0][-3000:]


def test_a_rank_stalled_where_nccl_would_not_tell_ends_when_its_peer_posts_a_failure(tiny_data, tmp_path):
    """Under NCCL a rank learns of a failed peer only at the collective timeout (30 minutes by default); gloo's
    wait on a stopped peer is the same. Rank 1 is stopped mid-run and its failure posted on the job's store, as
    a failing rank posts it: rank 0 ends within seconds, naming it, with EXIT_COLLECTIVE_FAILED."""
    import torch.distributed as dist

    from megatransformer.training.runtime.failure_board import STORE_TIMEOUT, FailureBoard

    run, log = tmp_path / "run", tmp_path / "train"
    ranks = spawn_ranks(overrides(tiny_data, run, "train.max_steps=100000", "wandb.mode=disabled"), log)
    try:
        wait_for_step(run, 3, ranks, Path(f"{log}.rank0.log"))
        ranks[1].send_signal(signal.SIGSTOP)
        port = int(psutil.Process(ranks[1].pid).environ()["MASTER_PORT"])
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=STORE_TIMEOUT, wait_for_workers=False)
        FailureBoard(store, rank=1, world_size=2).post("RuntimeError: CUDA error: an illegal memory access")
        posted = time.monotonic()
        code = wait_ranks(ranks[:1], log, timeout=120)[0]  # (parallel.timeout_minutes: the default 30)
        waited = time.monotonic() - posted
    finally:
        for rank in ranks:
            rank.kill()
    said = Path(f"{log}.rank0.log").read_text()
    assert code == EXIT_COLLECTIVE_FAILED, said[-3000:]
    assert waited < 60  # (a poll every POLL_SECONDS; the timeout is 30 minutes)
    assert (
        "megatransformer train: error: rank 0: ending: rank 1 failed: RuntimeError: CUDA error: an illegal memory "
        "access" in said
    ), said[-3000:]
