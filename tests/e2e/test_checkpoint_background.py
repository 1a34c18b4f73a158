"""Checkpoints written in the background: a run killed (SIGKILL) at any point of a write resumes exactly from
the previous checkpoint; each save is measured in metrics.jsonl and the log; checkpoint.every_minutes saves
by wall time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
from support.runs import ONE_THREAD, checkpoint_records, losses_by_step, tiny_run, train, train_command

from megatransformer import checkpoint as ckpt

# megatransformer train, killed outright inside the background writer of step 8's checkpoint, at POINT
KILLED_WHILE_WRITING = """
import os, signal, sys
from megatransformer import checkpoint as ckpt
from megatransformer.checkpoint import sharded
from megatransformer.cli import main
POINT = sys.argv.pop(1)
def kill():
    os.kill(os.getpid(), signal.SIGKILL)
def shard_cut_short(path, tensors, metadata):
    if path.parent.name == "step_000008":
        path.write_bytes(bytes(1000))
        kill()
    return written_shard(path, tensors, metadata)
def before_the_manifest(path, entries=None):
    if path.name == "step_000008":
        kill()
    return written_manifest(path, entries)
def before_latest(path, text):
    if path.name == ckpt.LATEST and text == "step_000008":
        kill()
    return written_latest(path, text)
written_shard, written_manifest, written_latest = sharded.write_safetensors, ckpt.write_manifest, ckpt.atomic_write
if POINT == "shard":
    sharded.write_safetensors = shard_cut_short
elif POINT == "manifest":
    ckpt.write_manifest = before_the_manifest
else:
    ckpt.atomic_write = before_latest
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def reference(tiny_data, tmp_path_factory):
    run = tmp_path_factory.mktemp("background") / "reference"
    train(tiny_run(tiny_data, run, steps=12), env=ONE_THREAD)
    return run


@pytest.mark.parametrize("point", ["shard", "manifest", "latest"])
def test_a_kill_during_a_background_write_resumes_exactly_from_the_previous_checkpoint(
    tiny_data, tmp_path, reference, point
):
    run = tmp_path / "run"
    overrides = tiny_run(tiny_data, run, steps=12)
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_WHILE_WRITING, point, *train_command()[3:], *overrides],
        capture_output=True,
        text=True,
        env={**os.environ, **ONE_THREAD},
        timeout=600,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    root = run / "checkpoints"
    assert (root / "latest").read_text() == "step_000004"
    assert (root / "step_000008" / ckpt.COMPLETE).is_file() == (point == "latest")
    (root / "step_000008" / "shard_00001.safetensors").write_bytes(b"as a killed run on two ranks leaves it")
    resumed = train([*overrides, "resume=auto"], env=ONE_THREAD)
    assert f"resumed from {root / 'step_000004'} at step 4" in resumed.stdout
    assert "starting fresh" not in resumed.stdout  # (a resume=auto run that resumed says only that)
    assert losses_by_step(run) == losses_by_step(reference)
    ckpt.verify_checkpoint(root / "step_000008")  # (saved again whole: nothing of the killed save is left)


def test_each_save_is_measured_in_the_metrics_and_the_log(tiny_data, tmp_path):
    """checkpoint.every_minutes small enough to save after every step (checkpoint.every is 1000): a record per
    save with its stall, write time and the bytes of every file of the checkpoint."""
    run = tmp_path / "run"
    overrides = tiny_run(tiny_data, run, steps=3, changes={"checkpoint.every": 1000, "checkpoint.keep": 5})
    done = train([*overrides, "checkpoint.every_minutes=0.00001"], env=ONE_THREAD)
    records = checkpoint_records(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        files = ckpt.read_manifest(run / "checkpoints" / f"step_{record['step']:06d}")
        assert record["ckpt_bytes"] == sum(entry["size"] for entry in files.values())
        assert 0 <= record["ckpt_setup_s"] <= record["ckpt_stall_s"] and 0 < record["ckpt_write_s"]
    # the first save sets up what the others reuse (the writers' group, the plan, host memory), and says so
    assert records[0]["ckpt_setup_s"] > max(records[1]["ckpt_setup_s"], records[2]["ckpt_setup_s"])
    lines = [line for line in done.stdout.splitlines() if line.startswith("checkpoint step ")]
    assert len(lines) == 3 and "in the background; training stalled" in lines[0], done.stdout[-2000:]
    assert "s of it setting up the saves: host memory, the writers' group)" in lines[0]
    index = json.loads((run / "checkpoints" / "step_000003" / "index.json").read_text())
    assert index["optimizer"]["step"] == 3


# megatransformer train, its step-4 save slowed down, ending with an error as soon as that save has started
FAILS_WHILE_WRITING = """
import sys, time
from data_pipeline import DataError
from megatransformer.checkpoint import sharded
from megatransformer.cli import main
from megatransformer.training.loop import Trainer
def slow_shard(path, tensors, metadata):
    if path.parent.name == "step_000004":
        time.sleep(3)
    return written_shard(path, tensors, metadata)
def save_then_fail(self):
    path = saved(self)
    if path.name == "step_000004":
        raise DataError("a data error while step 4's checkpoint is written")
    return path
written_shard, saved = sharded.write_safetensors, Trainer.save
sharded.write_safetensors, Trainer.save = slow_shard, save_then_fail
sys.exit(main(sys.argv[1:]))
"""


def test_a_run_ending_with_an_error_completes_the_save_in_flight(tiny_data, tmp_path):
    run = tmp_path / "run"
    failed = subprocess.run(
        [sys.executable, "-c", FAILS_WHILE_WRITING, *train_command()[3:], *tiny_run(tiny_data, run, steps=8)],
        capture_output=True,
        text=True,
        env={**os.environ, **ONE_THREAD},
        timeout=600,
    )
    assert failed.returncode == 2, failed.stderr[-3000:]
    lines = failed.stderr.splitlines()
    assert "megatransformer train: waiting for checkpoint step_000004, written in the background" in failed.stderr
    assert "megatransformer train: checkpoint step_000004 complete" in lines, failed.stderr[-3000:]
    assert lines[-1].startswith("megatransformer train: error: a data error while step 4's"), failed.stderr[-3000:]
    root = run / "checkpoints"
    assert (root / "latest").read_text() == "step_000004"
    ckpt.verify_checkpoint(root / "step_000004")


# megatransformer train, rank 1 killed outright while writing its shard of step 4's checkpoint
RANK_KILLED_WHILE_WRITING = """
import os, signal, sys
from megatransformer.checkpoint import sharded
from megatransformer.cli import main
def shard(path, tensors, metadata):
    if os.environ["RANK"] == "1" and path.parent.name == "step_000004":
        os.kill(os.getpid(), signal.SIGKILL)
    return written_shard(path, tensors, metadata)
written_shard, sharded.write_safetensors = sharded.write_safetensors, shard
sys.exit(main(sys.argv[1:]))
"""


def test_a_rank_dying_mid_save_leaves_the_survivor_one_line_not_the_writers_traceback(tiny_data, tmp_path):
    from support.runs import free_port

    run = tmp_path / "run"
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_KILLED_WHILE_WRITING, *train_command()[3:], *tiny_run(tiny_data, run, steps=8)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={
                **os.environ,
                **ONE_THREAD,
                **dict(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2"),
                **dict(MASTER_ADDR="127.0.0.1", MASTER_PORT=port),
            },
        )
        for r in range(2)
    ]
    try:
        _, err = ranks[0].communicate(timeout=600)
    finally:
        ranks[1].kill()
    assert ranks[0].returncode == 4, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("megatransformer train: error: rank 0: ")]
    # (gloo's reason for the failed collective, or first should the failure board's watcher see the process gone)
    assert len(errors) == 1, err[-3000:]
    assert "another rank is gone" in errors[0] or "rank 1 failed: its process ended without a line" in errors[0]
    assert not (run / "checkpoints" / "step_000004" / ckpt.COMPLETE).exists()
