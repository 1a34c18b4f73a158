"""Hang diagnosis in process: the per-rank watchdog's limit, its stack file when a step overruns, the NCCL
flight recorder's variables."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megatransformer.config import validate
from megatransformer.training.observability import watchdog as watchdog_module
from megatransformer.training.observability.watchdog import Watchdog, stack_dumps, switch_on_flight_recorder


@pytest.fixture(autouse=True)
def quick_looks(monkeypatch):
    """The watchdog looks at the deadline every 10 ms here (twice a second in a run): the same rules, sooner."""
    monkeypatch.setattr(watchdog_module, "POLL_SECONDS", 0.01)


def watchdog(tmp_path, **settings) -> Watchdog:
    cfg = validate({"run_dir": str(tmp_path), "parallel": {"timeout_minutes": 1.0}, "train": {"watchdog": settings}})
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


def stall(dump: Path, caller: str, then: float = 0.0) -> None:
    """Work that hangs until the watchdog has written ``caller``'s stack to ``dump`` (for 30 s at most: the
    test's assertions fail then), and ``then`` seconds more."""
    give_up = time.monotonic() + 30
    while time.monotonic() < give_up and not (dump.exists() and caller in dump.read_text()):
        time.sleep(0.01)
    time.sleep(then)


def stalled_step(dump: Path) -> None:
    stall(dump, "stalled_step", then=0.3)  # 30 more looks at the deadline, each of which might write again


def test_an_overrunning_step_leaves_every_threads_stack_and_a_quiet_one_nothing(tmp_path):
    dog = watchdog(tmp_path, limit_seconds=0.2)
    dog.arm()
    dog.disarm(0.01)  # a step in time
    dog.arm()
    stalled_step(dog.path)
    dog.disarm(0.5)
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


def stalled_checkpoint(dump: Path) -> None:
    stall(dump, "stalled_checkpoint")


def test_work_between_steps_leaves_its_stacks_before_the_collective_timeout(tmp_path):
    """A checkpoint or validation is collective work too: a peer stalled there leaves this rank waiting, so its
    stacks are written once it has run for 0.8 x the collective timeout (0.48 s here)."""
    cfg = validate({"run_dir": str(tmp_path), "parallel": {"timeout_minutes": 0.01}})
    dog = Watchdog(cfg, rank=1)
    with dog.watching("a checkpoint"):
        stalled_checkpoint(dog.path)
    dog.close()
    (dump,) = stack_dumps(tmp_path)
    text = dump.read_text()
    assert "a checkpoint has run for" in text and "stalled_checkpoint" in text
    assert "(watchdog limit 0.5 s" in text  # 0.48 s, as the docstring says


def test_work_on_groups_of_a_longer_timeout_is_watched_against_theirs(tmp_path):
    """train.evals gather on a group of their own timeout (hours): past 0.8 x the training's they are not a hang."""
    cfg = validate({"run_dir": str(tmp_path), "parallel": {"timeout_minutes": 0.01}})
    dog = Watchdog(cfg, rank=1)
    with dog.watching("validation and train.evals", timeout_minutes=1.0):
        time.sleep(1.0)  # (twice the training groups' 0.48 s)
    dog.close()
    assert stack_dumps(tmp_path) == []


def test_the_flight_recorder_is_switched_on_without_overriding_the_users_choice(tmp_path):
    environ = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}
    switch_on_flight_recorder(tmp_path, environ)
    assert environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path.resolve() / "hangs" / "nccl_trace_rank_")
    assert (tmp_path / "hangs").is_dir()
