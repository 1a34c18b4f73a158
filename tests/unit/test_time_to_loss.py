"""bench/time_to_loss.py's reading of a run: its validation curve on the trainer's clock, the first validation at
the target, and the table of the best rate of each pair."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from time_to_loss import Run, curve, table  # noqa: E402


def test_the_curve_starts_the_clock_at_the_first_steps_start(tmp_path):
    records = [
        {"step": 1, "kind": "train", "time": 102.0, "tokens": 100, "tokens_per_s": 50.0},  # began at 100.0
        {"step": 2, "kind": "train", "time": 103.0, "tokens": 200, "tokens_per_s": 100.0},
        {"step": 2, "kind": "valid", "time": 103.5, "val_loss": 5.0},
        {"step": 4, "kind": "valid", "time": 106.0, "val_loss": 4.0},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert curve(tmp_path) == [(2, 3.5, 5.0), (4, 6.0, 4.0)]


def test_the_table_reads_each_pairs_best_rate_against_the_baselines_time():
    def run(optimizer, schedule, lr, losses):
        return Run(optimizer, schedule, lr, [(10 * (i + 1), 2.0 * (i + 1), x) for i, x in enumerate(losses)])

    runs = [
        run("adamw", "cosine", 1e-3, [5.0, 4.6, 4.4]),
        run("adamw", "cosine", 2e-3, [4.9, 4.5, 4.2]),
        run("adamw", "cosine", 4e-3, [5.1, 4.7, 4.5]),
        run("muon", "wsd", 0.01, [4.5, 4.3, 4.1]),
        run("muon", "wsd", 0.02, [4.6, 4.2, 4.0]),  # reaches 4.2 at step 20, in 4 s
        run("muon", "wsd", 0.04, [4.8, 4.4, 4.3]),
    ]
    text = table(runs, 4.2, "adamw+cosine")
    assert "| adamw+cosine | 0.002 | 4.2000 | 30 | 6.0 | 1.00x |" in text
    assert "| muon+wsd | 0.02 | 4.0000 | 20 | 4.0 | 0.67x |" in text
    assert "(edge)" not in text
    runs[-1] = run("muon", "wsd", 0.04, [4.0, 3.9, 3.8])  # the largest rate wins: flagged
    assert "| muon+wsd | 0.04 (edge) |" in table(runs, 4.2, "adamw+cosine")
    assert runs[0].reach(4.0) is None and runs[3].reach(4.3) == (20, 4.0)
    assert pytest.approx(runs[3].final) == 4.1
