"""``python -m launch`` as a process: one-line errors, signals during start-up, and real training on one
process and under torchrun."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from support import REPO
from support.runs import ONE_THREAD, alive, clean_env, launch_command, losses, metrics, run_launch, write_tiny_config


def test_inconsistent_environment_is_one_line_and_exit_2():
    result = run_launch(["--config", "x.yaml"], clean_env(RANK="0", WORLD_SIZE="2"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "launch: error: RANK/WORLD_SIZE are set but LOCAL_RANK, MASTER_ADDR, MASTER_PORT not: start with torchrun, "
        "or set all of RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT"
    ]


def test_config_errors_come_from_the_trainer_with_exit_2(tmp_path):
    result = run_launch(["--config", str(tmp_path / "missing.yaml")], clean_env())
    assert result.returncode == 2
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


def test_signal_during_start_up_reaches_the_trainer_handler():
    """USR1 before the trainer installed its handler must not kill the process, and must not be lost."""
    script = textwrap.dedent("""
        import os, signal, time
        from launch.__main__ import EarlySignals
        EarlySignals()
        os.kill(os.getpid(), signal.SIGUSR1)     # arrives while 'the trainer is starting'
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.5)
        got = []
        signal.signal(signal.SIGUSR1, lambda s, f: got.append("USR1"))   # the trainer takes over
        signal.signal(signal.SIGTERM, lambda s, f: got.append("TERM"))
        deadline = time.time() + 10
        while len(got) < 2 and time.time() < deadline:
            time.sleep(0.05)
        print(",".join(got))
    """)
    result = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "USR1,TERM"


# --------------------------------------------------------------------------------------- real training


def final_train_loss(run_dir: Path) -> tuple[int, float]:
    last = [m for m in metrics(run_dir) if "loss" in m][-1]
    return last["step"], last["loss"]


def test_single_process_just_runs(tmp_path, tiny_data):
    config = write_tiny_config(tmp_path / "tiny.yaml", tiny_data, tmp_path / "run", max_steps=2)
    result = run_launch(["--config", str(config), "parallel.zero_stage=0"], clean_env(), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "launch: single process" in result.stdout
    trainer = json.loads((tmp_path / "run/checkpoints/step_000002/trainer.json").read_text())
    assert trainer["world_size"] == 1


def test_torchrun_two_processes_zero2(tmp_path, tiny_data):
    run_dir = tmp_path / "run"
    config = write_tiny_config(tmp_path / "tiny.yaml", tiny_data, run_dir, max_steps=6)
    command = [*launch_command(2), "--config", str(config)]
    result = subprocess.run(command, cwd=REPO, env=clean_env(**ONE_THREAD), capture_output=True, text=True, timeout=600)
    log = result.stdout + result.stderr
    assert result.returncode == 0, log
    assert "launch: torchrun: world 2 (2 per node)" in log
    assert final_train_loss(run_dir)[0] == 6
    assert all(loss == loss and loss < 10 for loss in losses(run_dir))  # finite, near ln(512) = 6.2 at the start
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints/latest").read_text().strip()
    trainer = json.loads((latest / "trainer.json").read_text())
    assert (trainer["step"], trainer["world_size"], trainer["zero_stage"]) == (6, 2, 2)
    # ZeRO-2 partitions the optimizer state: one shard per rank
    assert sorted(p.name for p in latest.glob("shard_*")) == ["shard_00000.safetensors", "shard_00001.safetensors"]


def test_a_rank_ends_when_its_launcher_is_killed(tmp_path):
    """torchrun starts each rank in a session of its own; a rank must not train on once its launcher is killed
    outright (SIGKILL), or it keeps writing into the run directory and holding its lock."""
    ready = tmp_path / "ready"
    rank = (
        "from megatransformer.training.runtime.distributed import end_with_launcher; end_with_launcher(); "
        f"open({str(ready)!r}, 'w').close(); import time; time.sleep(120)"
    )
    launcher = textwrap.dedent(f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", {rank!r}], start_new_session=True)
        print(child.pid, flush=True)
        time.sleep(120)
    """)
    process = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True, cwd=REPO)
    child = int(process.stdout.readline())
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():  # (the rank has asked to end with its launcher)
            assert time.monotonic() < deadline, "the rank did not start"
            time.sleep(0.05)
    finally:
        process.kill()
        process.wait()
    deadline = time.monotonic() + 30
    while alive(child):
        assert time.monotonic() < deadline, "the rank outlived its launcher"
        time.sleep(0.05)
