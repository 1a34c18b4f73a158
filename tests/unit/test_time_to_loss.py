"""bench/time_to_loss.py's reading of a run: its validation curve on the trainer's clock, the first validation at
the target, the table of the best rate of each pair, and a sweep continued from the runs it finished before."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from time_to_loss import Run, curve, run_settings, sweep, table  # noqa: E402

from megatransformer.config import load_config  # noqa: E402
from megatransformer.config.loading import dump_config  # noqa: E402


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


def sweep_args(out: Path, **changes) -> argparse.Namespace:
    settings = {"out": str(out), "config": None, "steps": 4, "evals": 2, "overrides": ["model.d_model=64"]}
    return argparse.Namespace(**{**settings, "muon_adam_lr": 1e-3, "jobs": 1, **changes})


def write_run(args: argparse.Namespace, optimizer: str, lr: float, losses: list[float]) -> Path:
    """A run directory as the trainer leaves it: its resolved config and a validation every two steps."""
    run_dir, overrides = run_settings(args, optimizer, "cosine", lr)
    run_dir.mkdir(parents=True)
    (run_dir / "config.yaml").write_text(dump_config(load_config(None, overrides)))
    records = [{"step": 1, "kind": "train", "time": 11.0, "tokens": 10, "tokens_per_s": 10.0}]
    records += [{"step": 2 * (i + 1), "kind": "valid", "time": 12.0 + i, "val_loss": x} for i, x in enumerate(losses)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return run_dir


def test_a_sweep_reads_the_runs_it_finished_before_in_order_and_refuses_others(tmp_path):
    args = sweep_args(tmp_path, jobs=2)
    lrs = {"adamw": [1e-3, 2e-3], "muon": [0.01, 0.02]}
    for optimizer, rates in lrs.items():
        for lr in rates:
            write_run(args, optimizer, lr, [5.0, 4.0 + lr])
    runs = sweep(args, [("adamw", "cosine"), ("muon", "cosine")], lrs)
    assert [(r.optimizer, r.lr, r.curve) for r in runs] == [
        (optimizer, lr, [(2, 2.0, 5.0), (4, 3.0, 4.0 + lr)]) for optimizer, rates in lrs.items() for lr in rates
    ]
    with pytest.raises(SystemExit, match="muon-cosine-lr0.01 holds another run"):  # its AdamW part at another rate
        sweep(sweep_args(tmp_path, muon_adam_lr=2e-3), [("muon", "cosine")], lrs)
    with pytest.raises(SystemExit, match="adamw-cosine-lr0.001 holds another run"):
        sweep(sweep_args(tmp_path, overrides=["model.d_model=96"]), [("adamw", "cosine")], lrs)


def test_a_run_stopped_before_its_last_validation_is_not_read_as_finished(tmp_path):
    args = sweep_args(tmp_path)
    write_run(args, "adamw", 1e-3, [5.0])  # validated at step 2 of 4
    with pytest.raises(SystemExit, match="adamw-cosine-lr0.001 holds an unfinished run: delete it"):
        sweep(args, [("adamw", "cosine")], {"adamw": [1e-3]})
    (tmp_path / "adamw-cosine-lr0.001" / "metrics.jsonl").write_text("")  # stopped before its first step
    with pytest.raises(SystemExit, match="unfinished run"):
        sweep(args, [("adamw", "cosine")], {"adamw": [1e-3]})


def test_jobs_run_at_once_each_with_its_share_of_the_cpus_as_threads(tmp_path, monkeypatch):
    import time_to_loss

    args = sweep_args(tmp_path, jobs=2)
    started = []

    def trainer(command, env, **_):  # a run as the trainer leaves it, written where its run_dir override says
        given = dict(str(a).split("=", 1) for a in command if "=" in str(a))  # (args.config is None here)
        run_dir, lr = Path(given["run_dir"]), float(given["optim.lr"])
        started.append(env["OMP_NUM_THREADS"])
        write_run(args, "adamw", lr, [5.0, 4.0 + lr])
        assert run_dir.is_dir()
        return argparse.Namespace(returncode=0)

    monkeypatch.setattr(time_to_loss.subprocess, "run", trainer)
    monkeypatch.setattr(time_to_loss.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4})
    runs = sweep(args, [("adamw", "cosine")], {"adamw": [1e-3, 2e-3, 4e-3]})
    assert [r.lr for r in runs] == [1e-3, 2e-3, 4e-3] and [r.final for r in runs] == [4.001, 4.002, 4.004]
    assert started == ["2", "2", "2"]  # 5 CPUs over 2 jobs
