"""Two runs on one run directory: while a run holds it, a second one (the same command, or resume=auto) exits 2
in one line naming the holder; once the holder is killed without a word (a preemption, a Slurm requeue), the
next run takes the lock over with a warning and resumes."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time

from support import assert_one_line
from support.runs import metrics, tiny_run, train, train_command

from megatransformer.training.checkpointing.run_lock import LOCK


def test_a_second_run_is_refused_while_the_first_holds_the_lock_and_a_requeue_resumes(tiny_data, tmp_path):
    run = tmp_path / "run"
    steps = 40  # (the stop below lands before the end, however busy the machine)
    overrides = tiny_run(tiny_data, run, steps=steps, changes={"checkpoint.every": 2, "resume": "auto"})
    first = subprocess.Popen(
        train_command() + overrides, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while not (run / "checkpoints" / "latest").is_file():
            assert first.poll() is None, f"the first run ended (exit {first.returncode}) before its first checkpoint"
            time.sleep(0.01)
        os.killpg(first.pid, signal.SIGSTOP)  # alive and holding the lock, however slow the second start is
        second = train(overrides, expect=2)
        assert_one_line(
            second.stderr,
            "megatransformer train: error:",
            f"run_dir={run} is in use by another run",
            f"pid {first.pid} on host {socket.gethostname()}",
        )
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(first.pid, signal.SIGKILL)  # killed without a word, as a preempted job's ranks are
        first.wait()
    saved = (run / "checkpoints" / "latest").read_text()
    requeued = train(overrides)
    assert f"taking over the lock of pid {first.pid} on host {socket.gethostname()}" in requeued.stderr
    assert f"resumed from {run / 'checkpoints' / saved} at step {int(saved[5:])}" in requeued.stdout
    assert "starting fresh" not in requeued.stdout  # (a resume=auto run that resumed says only that)
    logged = [r["step"] for r in metrics(run) if "loss" in r]
    assert logged == list(range(1, steps + 1))  # every step once: nothing written twice, nothing cut
    assert (run / LOCK).read_text() == ""  # released at the end
