"""A full disk (or any failed write) while checkpointing or writing shards: one line naming what failed, the free
space and what is intact, exit 5, nothing half-written left visible; the run then resumes from the last intact
checkpoint. The failures are real writes refused by the OS: ENOSPC from a patched safetensors writer (after it
wrote part of its file), and EFBIG from a file-size limit (RLIMIT_FSIZE: no root or small file system needed)."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys

from support import assert_one_line
from support.runs import CLI, ONE_THREAD, metrics, tiny_run, torchrun, train, train_command

from megatransformer.cli import EXIT_WRITE_FAILED

# megatransformer train with the second checkpoint's shard failing half way: the disk fills up
FILLS_UP_AT_STEP_8 = """
import errno, sys
from megatransformer.checkpoint import sharded
from megatransformer.cli import main
written = sharded.write_safetensors
def write_safetensors(path, tensors, metadata):
    if path.parent.name == "step_000008":
        path.write_bytes(bytes(4096))
        raise OSError(errno.ENOSPC, "No space left on device")
    return written(path, tensors, metadata)
sharded.write_safetensors = write_safetensors
sys.exit(main(sys.argv[1:]))
"""


# the same on two ranks, where only rank 1's own state file of the second checkpoint fails
RANK_1_FILLS_UP_AT_STEP_8 = """
import errno, sys
from megatransformer.checkpoint import sharded
from megatransformer.cli import main
written = sharded.write_file
def write_file(path, data):
    if str(path).endswith("step_000008/rank_00001.pt"):
        raise OSError(errno.ENOSPC, "No space left on device")
    return written(path, data)
sharded.write_file = write_file
sys.exit(main(sys.argv[1:]))
"""


def limit_file_size(size: int):
    """For a child process: files may grow to ``size`` bytes; a write beyond fails with EFBIG (not SIGXFSZ)."""

    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return apply


def test_a_disk_full_while_checkpointing_ends_in_one_line_and_the_run_resumes(tiny_data, tmp_path):
    run = tmp_path / "run"
    overrides = tiny_run(tiny_data, run, steps=12)
    full = subprocess.run(
        [sys.executable, "-c", FILLS_UP_AT_STEP_8, *train_command()[3:], *overrides], capture_output=True, text=True
    )
    assert full.returncode == EXIT_WRITE_FAILED, full.stderr[-3000:]
    assert_one_line(
        full.stderr,
        "megatransformer train: error: writing checkpoint step_000008 failed (shard_00000.safetensors): "
        "No space left on device (",
        f"MiB free on {run / 'checkpoints'}); the last intact checkpoint is step_000004 (resume=auto continues",
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["latest", "step_000004"]  # no half
    assert (run / "checkpoints" / "latest").read_text() == "step_000004"
    resumed = train([*overrides, "resume=auto"])
    assert f"resumed from {run / 'checkpoints' / 'step_000004'} at step 4" in resumed.stdout
    assert [r["step"] for r in metrics(run) if "loss" in r] == list(range(1, 13))


def test_one_ranks_failed_write_ends_every_rank_in_one_line_without_waiting(tiny_data, tmp_path):
    """The ranks agree on a failed write in place of the save's barrier: none waits for the timeout."""
    run, script = tmp_path / "run", tmp_path / "fills_up.py"
    script.write_text(RANK_1_FILLS_UP_AT_STEP_8)
    result = subprocess.run(
        [*torchrun(2), str(script), *train_command()[3:], *tiny_run(tiny_data, run, steps=12)],
        capture_output=True,
        text=True,
        env={**os.environ, **ONE_THREAD},
        timeout=600,
    )
    lines = [line for line in result.stderr.splitlines() if "megatransformer train: error:" in line]
    assert len(lines) == 2, result.stderr[-3000:]  # one per rank
    for line in lines:
        assert "writing checkpoint step_000008 failed on rank 1 (rank_00001.pt): No space left on device" in line
        assert "the last intact checkpoint is step_000004" in line
    assert [p.name for p in (run / "checkpoints").glob("step_*")] == ["step_000004"]
    assert (run / "checkpoints" / "latest").read_text() == "step_000004"


def test_a_file_too_large_for_the_first_checkpoint_says_no_checkpoint_is_complete(tiny_data, tmp_path):
    run = tmp_path / "run"
    result = subprocess.run(
        train_command() + tiny_run(tiny_data, run, steps=4),
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size(64 << 10),
    )
    assert result.returncode == EXIT_WRITE_FAILED, result.stderr[-3000:]
    assert_one_line(
        result.stderr,
        "megatransformer train: error: writing checkpoint step_000004 failed (",
        "MiB free on",
        "no checkpoint of this run is complete yet",
    )
    assert not list((run / "checkpoints").glob("step_*")) and not (run / "checkpoints" / "latest").exists()


def test_a_failed_shard_write_ends_in_one_line_and_leaves_no_shard(tiny_data, tmp_path):
    out = tmp_path / "shards"
    result = subprocess.run(
        [*CLI, "data", "shard", "--input", tiny_data.corpus, "--tokenizer", tiny_data.tokenizer, "--out", out]
        + ["--workers", "1"],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size(16 << 10),
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == EXIT_WRITE_FAILED, result.stderr[-3000:]
    assert_one_line(
        result.stderr, f"megatransformer data: error: writing shards to {out} failed: File too large (", "MiB free on"
    )
    assert not out.exists() or not list(out.iterdir())
