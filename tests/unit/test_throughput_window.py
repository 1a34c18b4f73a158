"""The training record's throughput window (training/loop.py ``Window``): validation and train.evals inside it are
left out of the steps' time."""

from __future__ import annotations

import pytest

from megatransformer.training import loop
from megatransformer.training.engine.train_module import StepResult


def test_the_time_of_a_validation_is_left_out_of_the_steps_throughput(monkeypatch):
    clock = iter([0.0, 10.0, 70.0, 80.0, 80.0])  # the window starts; a validation from 10 s to 70 s; the record at 80 s
    monkeypatch.setattr(loop.time, "perf_counter", lambda: next(clock))
    window = loop.Window(peak_flops=1e6)
    window.add(StepResult(loss=1.0, tokens=1000, model_flops=2e6, finite=True, stop=False, lr=1e-3))
    with window.paused():
        pass
    assert window.take() == pytest.approx({"tokens_per_s": 1000 / 20, "mfu": 2e6 / 20 / 1e6})
