"""The run directory's lock in one process: a record left by a holder that is gone is taken over with a warning
(another host's process cannot be checked, and the warning says so); a released lock is taken without a word.
Two processes on one directory: tests/e2e/test_run_dir_lock.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
from support.models import run_config

from megatransformer.config import ConfigError
from megatransformer.training.checkpointing.resume import check_run_dir
from megatransformer.training.checkpointing.run_lock import LOCK, lock_run_dir


def left_record(run_dir, **record) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LOCK).write_text(json.dumps({"pid": 4242, "started": "2026-01-01 00:00:00", "job": None} | record))


def test_a_released_lock_is_taken_without_a_word_and_holds_this_process(tmp_path, capsys):
    lock = lock_run_dir(tmp_path / "run")
    record = json.loads((tmp_path / "run" / LOCK).read_text())
    assert record["host"] == socket.gethostname() and record["pid"] == os.getpid()
    lock.release()
    assert (tmp_path / "run" / LOCK).read_text() == ""  # released: empty
    lock_run_dir(tmp_path / "run").release()
    assert capsys.readouterr().err == ""


def test_the_record_of_a_process_gone_on_this_host_is_taken_over_with_a_warning(tmp_path, capsys):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left_record(tmp_path, host=socket.gethostname(), pid=int(gone.stdout))
    lock_run_dir(tmp_path).release()
    (line,) = capsys.readouterr().err.splitlines()
    assert f"taking over the lock of pid {int(gone.stdout)} on host {socket.gethostname()}" in line
    assert "ended without releasing it" in line


def test_another_hosts_record_is_taken_over_saying_its_process_cannot_be_checked(tmp_path, capsys):
    left_record(tmp_path, host="node-17", job="SLURM_JOB_ID=991")
    lock_run_dir(tmp_path).release()
    (line,) = capsys.readouterr().err.splitlines()
    assert "pid 4242 on host node-17, SLURM_JOB_ID=991" in line
    assert "a process on another host cannot be checked" in line and "stop this one" in line


def test_an_unreadable_record_is_taken_over_naming_it(tmp_path, capsys):
    (tmp_path / LOCK).write_bytes(b"\x00garbage{")
    lock_run_dir(tmp_path).release()
    assert "unreadable record" in capsys.readouterr().err


def _refusal(run_dir) -> str:
    with pytest.raises(ConfigError) as refusal:
        lock_run_dir(run_dir)
    assert "\n" not in str(refusal.value)
    return str(refusal.value)


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LOCK).symlink_to(victim)
    assert "is a symbolic link" in _refusal(tmp_path / "run")
    os.unlink(tmp_path / "run" / LOCK)
    os.link(victim, tmp_path / "run" / LOCK)
    assert "a hard link" in _refusal(tmp_path / "run")
    assert victim.read_text() == "precious"


def test_a_lock_file_that_is_a_directory_or_a_fifo_is_refused(tmp_path):
    (tmp_path / "run" / LOCK).mkdir(parents=True)
    assert "is a directory" in _refusal(tmp_path / "run")
    os.mkfifo(tmp_path / "fifo_run_lock")
    (tmp_path / "other").mkdir()
    os.rename(tmp_path / "fifo_run_lock", tmp_path / "other" / LOCK)
    assert "not a regular file" in _refusal(tmp_path / "other")


def test_a_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("")
    assert "is a file, not a directory" in _refusal(tmp_path / "run")
    assert "is a file, not a directory" in _refusal(tmp_path / "run" / "below")
    cfg = run_config(run_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match="is a file, not a directory"):
        check_run_dir(cfg)  # (every rank, before any process group)
