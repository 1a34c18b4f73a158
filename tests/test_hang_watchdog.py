"""Hang diagnosis: the per-rank watchdog writes every thread's stack when a step overruns (in process), and a
stalled rank of two leaves a stack dump per rank while both exit non-zero (real torchrun processes)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from megatransformer.config import validate
from megatransformer.training.watchdog import Watchdog, stack_dumps, switch_on_flight_recorder


def watchdog(tmp_path, **settings) -> Watchdog:
    cfg = validate({"run_dir": str(tmp_path), "parallel": {"timeout_minutes": 1.0},
                    "train": {"watchdog": settings}})
    return Watchdog(cfg, rank=3)


def test_the_limit_follows_the_median_step_within_the_collective_timeout(tmp_path):
    dog = watchdog(tmp_path, factor=10, min_seconds=2)
    assert dog.limit() == 48  # no settled steps yet: 0.8 x the 60 s collective timeout
    for seconds in (0.1, 0.3, 0.5):
        dog.disarm(seconds)
    assert dog.limit() == 3.0  # 10 x the median 0.3 s
    for seconds in (10, 10, 10):
        dog.disarm(seconds)
    assert dog.limit() == 48  # 10 x 10 s would outlast the timeout: capped
    assert watchdog(tmp_path, limit_seconds=5).limit() == 5


def stalled_step() -> None:
    time.sleep(1.5)


def test_an_overrunning_step_leaves_every_threads_stack_and_a_quiet_one_nothing(tmp_path):
    dog = watchdog(tmp_path, limit_seconds=0.2)
    dog.arm()
    dog.disarm(0.01)  # a step in time
    dog.arm()
    stalled_step()
    dog.disarm(1.5)
    dog.close()
    (dump,) = stack_dumps(tmp_path)
    assert dump.name == "rank_00003.txt"
    text = dump.read_text()
    assert "watchdog limit 0.2 s" in text and "stalled_step" in text
    assert text.count("a step has run for") == 1  # once per step
    quiet = watchdog(tmp_path / "quiet", limit_seconds=5)
    quiet.arm()
    quiet.disarm(0.01)
    quiet.close()
    assert stack_dumps(tmp_path / "quiet") == [] and not (tmp_path / "quiet" / "hangs").exists()


def test_the_flight_recorder_is_switched_on_without_overriding_the_users_choice(tmp_path):
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    switch_on_flight_recorder(tmp_path, environ)
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path.resolve() / "hangs" / "nccl_trace_rank_")
    assert (tmp_path / "hangs").is_dir()


@pytest.mark.slow
def test_a_stalled_rank_leaves_a_stack_dump_per_rank_and_every_rank_exits_non_zero(tiny_data, tmp_path):
    from test_run_faults import _rank_processes, _wait_for_step, overrides

    run = tmp_path / "run"
    log = (tmp_path / "stderr.log").open("w")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m",
         "megatransformer.cli", "train", "--config", os.devnull,
         *overrides(tiny_data, run, "train.max_steps=100000", "parallel.timeout_minutes=0.5", "wandb.mode=disabled",
                    "train.watchdog.min_seconds=3")],
        stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "DS_ACCELERATOR": "cpu"}, start_new_session=True)
    ranks: dict[int, psutil.Process] = {}
    try:
        _wait_for_step(launcher, run / "metrics.jsonl", 5, tmp_path / "stderr.log")
        ranks = _rank_processes(launcher)
        ranks[1].send_signal(signal.SIGSTOP)
        codes = [ranks[0].wait(timeout=300)]  # after its watchdog wrote, its collective times out
        ranks[1].send_signal(signal.SIGCONT)  # its own watchdog is overdue: it writes at once; its peer is gone
        codes.append(ranks[1].wait(timeout=300))
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
    assert all(code != 0 for code in codes) and launcher.returncode != 0, (codes, stderr[-3000:])
    dumps = stack_dumps(run)
    assert [d.name for d in dumps] == ["rank_00000.txt", "rank_00001.txt"], stderr[-3000:]
    for dump in dumps:  # each names where its rank waited: a step of the training loop
        assert "in step" in dump.read_text() and "loop.py" in dump.read_text(), dump.read_text()
    line = next(line for line in stderr.splitlines() if "error: rank 0:" in line)
    assert f"{run / 'hangs'}/ (rank_00000.txt" in line
