"""``train.profile``: the window's bounds are checked with the config, the profiler opens and closes on them, and a
run that ends inside the window still writes what it profiled."""

from __future__ import annotations

import json

import pytest
import torch

from megatransformer.config import ConfigError, ProfileConfig, load_config
from megatransformer.training.observability.profiling import StepProfiler


def test_a_window_past_the_run_is_refused_with_the_step_to_start_at():
    with pytest.raises(ConfigError, match=r"train.profile.start=9 with train.profile.steps=3 ends past "):
        load_config("llama-style", ["train.max_steps=10", "train.profile.start=9"])
    with pytest.raises(ConfigError, match="start it at step 8 or earlier"):
        load_config("llama-style", ["train.max_steps=10", "train.profile.start=9"])
    assert load_config("llama-style", ["train.max_steps=10", "train.profile.start=8"]).train.profile.steps == 3
    with pytest.raises(ConfigError, match="train.profile.steps"):
        load_config("llama-style", ["train.profile.steps=0"])


def step(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ x).sum()


def test_the_window_opens_and_closes_on_its_steps(tmp_path):
    profiler = StepProfiler(ProfileConfig(start=2, steps=2), tmp_path, rank=3, device=torch.device("cpu"))
    lines = []
    for n in range(1, 6):
        lines.append(profiler.step_starts(n))
        step(torch.randn(64, 64))
        lines.append(profiler.step_ended(n))
    assert [(i // 2 + 1, line) for i, line in enumerate(lines) if line] == [
        (2, "profiling steps 2-3 (train.profile)"),
        (3, lines[5]),
    ]
    assert lines[5].startswith("profile of 2 step(s): ") and f"{tmp_path}/profile/rank_00003.txt" in lines[5]
    profile = json.loads((tmp_path / "profile" / "rank_00003.json").read_text())
    [mm] = [row for row in profile["top"] if row["name"] == "aten::mm"]
    assert mm["calls"] == 1.0 and mm["on"] == "cpu"  # per step; an operator (a kernel on a GPU: "cuda")
    assert profiler.close() is None  # (closed)


def test_no_window_profiles_nothing_and_a_run_ended_inside_one_writes_it(tmp_path):
    off = StepProfiler(ProfileConfig(), tmp_path / "off", rank=0, device=torch.device("cpu"))
    assert [off.step_starts(n) for n in (0, 1, 2)] == [None] * 3 and off.close() is None
    assert not (tmp_path / "off").exists()
    cut = StepProfiler(ProfileConfig(start=1, steps=5), tmp_path, rank=0, device=torch.device("cpu"))
    cut.step_starts(1)
    step(torch.randn(8, 8))
    assert cut.step_ended(1) is None
    assert cut.close().startswith("profile of 1 step(s): ")  # (the loop ended: a stop, a divergence)
    assert json.loads((tmp_path / "profile" / "rank_00000.json").read_text())["steps"] == 1


def test_a_profiler_that_fails_leaves_a_line_and_the_run_going(tmp_path, monkeypatch):
    from megatransformer.training.observability import profiling

    class Broken:
        def __init__(self, activities):
            pass

        def start(self):
            raise RuntimeError("CUPTI is not available")

    monkeypatch.setattr(profiling, "profile", Broken)
    profiler = StepProfiler(ProfileConfig(start=1, steps=2), tmp_path, rank=0, device=torch.device("cpu"))
    line = profiler.step_starts(1)
    assert (
        line == "train.profile: torch.profiler did not start (RuntimeError: CUPTI is not available); training goes on"
    )
    assert profiler.step_ended(1) is None and profiler.step_ended(2) is None and profiler.close() is None
    assert not (tmp_path / "profile").exists()
