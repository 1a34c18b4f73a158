"""Never silent at start-up: a first line before PyTorch loads, a line before each one-time DeepSpeed op build and
before each wait on another process's build lock, a line each minute while either goes on, and no build at all
for a single process; the first step announced, and the trainer's warnings never held back with DeepSpeed's output."""

from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from support.runs import ONE_THREAD, tiny_data_overrides, train_command

from megatransformer.training.runtime.builds import COLLECTIVE, CPU_ADAM, build_notes, build_progress, ops_to_build

TINY = (
    "model.d_model=32 model.n_layers=1 model.n_heads=2 model.n_kv_heads=2 model.d_ff=64 model.vocab_size=512 "
    "model.max_seq_len=64 data.seq_len=32 train.micro_batch_size=2 train.grad_accum=1 train.eval_batches=1 "
    "wandb.mode=disabled"
).split()


def test_the_ops_a_run_builds():
    assert ops_to_build(world_size=1, cuda=False, offload_optimizer=False) == []
    assert ops_to_build(world_size=2, cuda=False, offload_optimizer=False) == [COLLECTIVE]
    assert ops_to_build(world_size=8, cuda=True, offload_optimizer=False) == []
    assert ops_to_build(world_size=1, cuda=True, offload_optimizer=True) == [CPU_ADAM]


def test_a_build_and_a_lock_are_announced_a_built_op_is_not(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    (building,) = build_notes([COLLECTIVE])
    assert building == (
        f"building DeepSpeed's CPU collective ({COLLECTIVE}) in {tmp_path / COLLECTIVE}: once per "
        "machine, 2-4 min on 2 idle cores, 7 or more on a busy machine"
    )
    (tmp_path / COLLECTIVE / f"{COLLECTIVE}.so").touch()
    assert build_notes([COLLECTIVE]) == []
    lock = tmp_path / COLLECTIVE / "lock"
    lock.touch()
    (waiting,) = build_notes([COLLECTIVE], now=lock.stat().st_mtime + 3600)
    assert waiting.startswith(
        f"waiting for another process's build of DeepSpeed's CPU collective ({COLLECTIVE}): "
        f"its lock file {lock} is 60 min old;"
    )
    assert waiting.endswith("if no build is running (a killed one leaves its lock behind), delete that file")


def test_a_build_or_wait_that_goes_on_says_so_every_interval(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = tmp_path / COLLECTIVE / "lock"
    lock.parent.mkdir()
    lock.touch()
    out = io.StringIO()
    with build_progress([COLLECTIVE], out, every=0.05):
        deadline = time.monotonic() + 60  # (its thread may run late on a busy machine)
        while len(out.getvalue().splitlines()) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    said = out.getvalue().splitlines()
    assert len(said) >= 2, said
    waiting = rf"still waiting for DeepSpeed's CPU collective \({COLLECTIVE}\) to build \(\d+ s so far\)"
    assert re.match(waiting, said[0]), said[0]
    assert said[0].endswith(f"lock file {lock}")
    lock.unlink()  # the build ended, or nothing is built
    for ops in ([COLLECTIVE], []):
        quiet = io.StringIO()
        with build_progress(ops, quiet, every=0.01):
            time.sleep(0.1)
        assert quiet.getvalue() == ""


def run_command(tiny_data, run_dir: Path) -> list[str]:
    return [*train_command(), *TINY, *tiny_data_overrides(tiny_data), f"run_dir={run_dir}", "train.max_steps=1"]


def test_a_single_process_builds_nothing(tiny_data, tmp_path):
    extensions = tmp_path / "torch_extensions"  # a fresh machine's: nothing built yet
    extensions.mkdir()
    result = subprocess.run(
        run_command(tiny_data, tmp_path / "run"),
        capture_output=True,
        text=True,
        env={**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions)},
        timeout=900,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.splitlines()[0] == f"training {tmp_path / 'run'} to step 1: starting PyTorch and DeepSpeed"
    assert "building" not in result.stdout and list(extensions.iterdir()) == []


def first_lines_until(process: subprocess.Popen, wanted: str) -> list[str]:
    """The process's output lines up to the first one containing ``wanted``, read while it runs."""
    lines = []
    for line in process.stdout:
        lines.append(line.rstrip("\n"))
        if wanted in line:
            return lines
    raise AssertionError(
        f"the process ended (exit {process.wait()}) without a line saying {wanted!r}:\n" + "\n".join(lines[-30:])
    )


@pytest.mark.parametrize("lock_left", [False, True], ids=["fresh", "lock_left"])
def test_a_rank_says_what_it_waits_for_before_it_waits(tiny_data, tmp_path, lock_left):
    """Rank 0 of a 2-rank CPU run (its peer never starts: the build, or the wait on the lock, comes first)."""
    extensions = tmp_path / "torch_extensions"
    lock = extensions / COLLECTIVE / "lock"
    if lock_left:  # a build killed midway leaves its lock: torch would wait for it for ever
        lock.parent.mkdir(parents=True)
        lock.touch()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(extensions),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    process = subprocess.Popen(
        run_command(tiny_data, tmp_path / "run"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        lines = first_lines_until(process, "waiting for another process's build" if lock_left else "building")
        assert process.poll() is None  # said before it waits, not after
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # (with the compiler, if it builds)
        process.wait()
    assert lines[0] == f"training {tmp_path / 'run'} to step 1: starting PyTorch and DeepSpeed"
    if lock_left:
        assert f"its lock file {lock} is" in lines[-1] and "delete that file" in lines[-1]
    else:
        assert lines[-1] == (
            f"building DeepSpeed's CPU collective ({COLLECTIVE}) in {extensions / COLLECTIVE}: once "
            "per machine, 2-4 min on 2 idle cores, 7 or more on a busy machine"
        )
        assert not list((extensions / COLLECTIVE).glob("*.so"))  # the build had not finished


def test_a_small_validation_split_is_warned_about_and_the_first_step_announced(tiny_data, tmp_path):
    """Without --verbose (DeepSpeed's start-up output is held back, the trainer's own lines are not): the
    validation split of one short document is less than one batch of 8; the seconds of the first step are said."""
    from data_pipeline.shard import write_shards

    functions = "".join(f"def add_{i}(x):\n    return x + {i}\n" for i in range(6))
    (tmp_path / "valid.txt").write_text(f"def one():\n    return 1\n\n{functions}")  # the second is valid's
    write_shards(
        [str(tmp_path / "valid.txt")],
        str(tiny_data.tokenizer),
        tmp_path / "valid",
        valid_every=2,
        workers=1,
        progress=False,
    )
    command = [
        *run_command(tiny_data, tmp_path / "run"),
        f"data.valid={tmp_path / 'valid'}",
        "train.micro_batch_size=8",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **ONE_THREAD}, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert any(
        re.match(r"warning: the validation split holds [1-7] sequences?, less than one batch of 8", line)
        for line in lines
    )
    announced = next(i for i, line in enumerate(lines) if line.startswith("step 1: first step of this process ("))
    assert announced < next(i for i, line in enumerate(lines) if line.startswith("step 1/1 |"))
