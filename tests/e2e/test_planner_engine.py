"""The planner's memory estimate against the trainer's own step (``TrainModule.step``: DeepSpeed's engine) on two
gloo ranks: the measured peak of live tensor bytes per rank (``bench/plan_memory.py``) within 10% of the plan."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from plan_memory import engine_peak, planned  # noqa: E402

MODEL = dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=176, vocab_size=512, attention_backend="chunked")


@pytest.mark.parametrize(
    "zero, precision",
    [
        (0, "fp32"),  # torch AdamW, the flat all-reduce copy
        (1, "fp32"),  # DeepSpeed's 5e8-element reduction bucket, allocated in every backward
    ],
)
def test_engine_peak_on_two_ranks_is_the_plan_within_ten_percent(zero: int, precision: str) -> None:
    point = {
        "model": MODEL | {"max_seq_len": 256},
        "seq_len": 256,
        "micro_batch": 2,
        "precision": precision,
        "zero": zero,
        "ranks": 2,
        "runner": "engine",
    }
    measured = engine_peak(point)
    total = planned(point)["total"]
    assert 0.9 < total / measured < 1.1, f"plan {total / 2**20:.2f} MiB, measured {measured / 2**20:.2f} MiB"
