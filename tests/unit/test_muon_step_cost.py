"""bench/muon_step_cost.py's reading of a run: the gaps between consecutive steps after the warm-up."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from muon_step_cost import step_gaps  # noqa: E402


def train_record(step: int, time: float) -> dict:
    return {"step": step, "kind": "train", "time": time, "tokens": 256 * step}


def test_the_gaps_after_the_warm_up_and_the_tokens_of_a_step():
    records = [train_record(1, 10.0), train_record(2, 12.0), {"step": 2, "kind": "valid", "time": 12.5}]
    records += [train_record(3, 13.5), train_record(4, 14.75)]
    gaps, tokens = step_gaps(records, warmup=2)
    assert gaps == [1.5, 1.25]  # (steps 3 and 4; step 2's gap, the warm-up's, left out)
    assert tokens == 256


def test_a_run_that_did_not_log_every_step_is_refused():
    with pytest.raises(SystemExit, match="a train record every step"):
        step_gaps([train_record(1, 1.0), train_record(3, 2.0), train_record(4, 3.0)], warmup=0)
