"""The training loop with results read a step late: a run that logs every 5th step (the other steps' results
read during the next step) takes the same decisions as the run that logs every step: the same spikes skipped,
losses, validation and checkpoint; a run of non-finite steps stops one step later. Real `megatransformer train`
processes."""

from __future__ import annotations

import json
from pathlib import Path

from support.runs import losses_by_step, metrics, tiny_run, train

# tight spike limits on the loss and the gradient norm, no rollback: several steps skipped
SPIKES = {
    "train.spikes.window": 4,
    "train.spikes.warmup": 2,
    "train.spikes.threshold": 0.05,
    "train.spikes.min_rise": 1e-6,
    "train.spikes.grad_norm": "true",
    "train.spikes.grad_norm_threshold": 0.05,
    "train.spikes.grad_norm_min_rise": 1e-6,
    "train.spikes.rollback_after": 50,
}


def run(tiny_data, run_dir: Path, log_every: int) -> str:
    changes = SPIKES | {"train.log_every": log_every, "checkpoint.every": 10, "train.eval_every": 10}
    return train(tiny_run(tiny_data, run_dir, steps=20, changes=changes)).stdout


def trainer_state(run_dir: Path) -> dict:
    latest = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text()
    return json.loads((latest / "trainer.json").read_text())


def test_results_read_a_step_late_give_the_run_read_every_step(tiny_data, tmp_path):
    every, late = tmp_path / "every", tmp_path / "late"
    run(tiny_data, every, 1)
    run(tiny_data, late, 5)
    events = [(r["step"], r["event"], r["spike_loss"]) for r in metrics(every) if "event" in r]
    assert len(events) >= 4 and all(event == "skip" for _, event, _ in events), events
    assert [(r["step"], r["event"], r["spike_loss"]) for r in metrics(late) if "event" in r] == events
    logged = losses_by_step(late)
    assert sorted(logged) == [5, 10, 15, 20]
    assert logged == {step: loss for step, loss in losses_by_step(every).items() if step in logged}
    validation = [(r["step"], r["val_loss"]) for r in metrics(every) if "val_loss" in r]
    assert [(r["step"], r["val_loss"]) for r in metrics(late) if "val_loss" in r] == validation
    state_every, state_late = trainer_state(every), trainer_state(late)
    assert state_late["step"] == 20 and state_late["spikes"] == state_every["spikes"]
    assert state_late["tokens"] == state_every["tokens"]


def test_non_finite_steps_read_late_stop_a_step_later_with_a_checkpoint(tiny_data, tmp_path):
    run_dir = tmp_path / "nan"
    # init_std 1e39 overflows float32: infinite weights, a NaN loss from the first step
    changes = {"train.log_every": 5}
    overrides = tiny_run(tiny_data, run_dir, changes=changes) + ["model.init_std=1e39", "train.max_bad_steps=2"]
    result = train(overrides, expect=3)
    for step in (1, 2, 3):
        assert f"step {step}: non-finite loss or gradients, update skipped ({step} in a row)" in result.stdout
    assert "stopping: 3 consecutive non-finite steps" not in result.stdout
    assert "stopping: 2 consecutive non-finite steps" in result.stdout
    assert (run_dir / "checkpoints" / "latest").read_text() == "step_000003"


def test_a_rollback_decided_a_step_late_rolls_back_as_at_once(tiny_data, tmp_path):
    """The ladder rolls back over the same rows, from the same checkpoint, at the same step, and stops at the
    same spike when its results come a step late (the step run since then is in the run, its spike skipped)."""
    ladder = SPIKES | {"train.spikes.rollback_after": 2, "train.spikes.within": 3, "train.spikes.max_rollbacks": 1}
    ladder |= {"train.spikes.margin_steps": 1, "checkpoint.every": 4, "train.eval_every": 0}
    ladder |= {"train.spikes.window": 6, "train.spikes.warmup": 6}  # (no spike before the first checkpoint)
    records = {}
    for log_every in (1, 5):
        run_dir = tmp_path / f"log_every_{log_every}"
        changes = ladder | {"train.log_every": log_every}
        train(tiny_run(tiny_data, run_dir, steps=30, changes=changes), expect=None)
        fields = ("step", "event", "spike_loss", "checkpoint", "skipped_rows", "spike_began")
        records[log_every] = [tuple(r.get(f) for f in fields) for r in metrics(run_dir) if "event" in r]
    assert [event for _, event, *_ in records[1]].count("rollback") == 1, records[1]
    assert records[1][-1][1] == "stop", records[1]
    assert records[5][: len(records[1])] == records[1]
    after_the_stop = [(step, event) for step, event, *_ in records[5][len(records[1]) :]]
    assert after_the_stop in ([], [(records[1][-1][0] + 1, "skip")])
