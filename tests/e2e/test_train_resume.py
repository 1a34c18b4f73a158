"""Exact resume on two data-parallel ranks (ZeRO-2, gradient accumulation, periodic validation).

The ranks are spawned directly with RANK / WORLD_SIZE / MASTER_* in their environment (as srun does), so
each rank's exit code and pid are ours: the run is killed with SIGKILL on every rank at an arbitrary step,
resumed, preempted with SIGUSR1 sent to one rank only (both ranks must checkpoint and exit 124), resumed
again, and its metrics.jsonl must equal an uninterrupted run's line by line.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from support.runs import (
    FOUR_STEPS,
    ONE_THREAD,
    metrics,
    spawn_ranks,
    tiny_data_overrides,
    tiny_model,
    train,
    wait_for_checkpoint,
    wait_for_step,
    wait_ranks,
)

STEPS = 24  # (room for a preemption signal to land before the end on a busy machine)
EXACT = ("step", "loss", "lr", "grad_norm", "tokens", "val_loss", "val_tokens", "bad_steps")


def overrides(tiny_data, run_dir: Path) -> list[str]:
    return [
        *tiny_model(d_model=32, d_ff=64, max_seq_len=32),
        f"run_dir={run_dir}",
        *tiny_data_overrides(tiny_data),
        "data.seq_len=32",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        f"train.max_steps={STEPS}",
        "train.log_every=1",
        "train.eval_every=5",
        "train.eval_batches=1",
        "optim.lr=1e-2",
        "schedule.warmup_steps=2",
        "checkpoint.every=3",
        "checkpoint.keep=2",
        "parallel.zero_stage=2",
        "wandb.mode=disabled",
        "resume=auto",
    ]


def records(run_dir: Path) -> list[dict]:
    return [{k: v for k, v in record.items() if k in EXACT} for record in metrics(run_dir)]


def test_kill_9_then_preemption_then_resume_equals_uninterrupted(tiny_data, tmp_path):
    reference, run = tmp_path / "reference", tmp_path / "interrupted"
    assert wait_ranks(spawn_ranks(overrides(tiny_data, reference), reference), reference) == [0, 0]

    procs = spawn_ranks(overrides(tiny_data, run), run)  # 1. killed -9 on every rank, between checkpoints
    wait_for_step(run, 5, procs)
    wait_for_checkpoint(run, procs)  # (step 3's, written in the background)
    for p in procs:
        p.send_signal(signal.SIGKILL)
    wait_ranks(procs, run)
    killed_at = max(r["step"] for r in records(run))
    latest = int((run / "checkpoints" / "latest").read_text().removeprefix("step_"))
    assert latest % 3 == 0 and 3 <= latest <= killed_at  # a save cut short by the kill is not `latest`

    procs = spawn_ranks(overrides(tiny_data, run), run)  # 2. resumed, then preempted through one rank only
    wait_for_step(run, killed_at + 2, procs)
    procs[1].send_signal(signal.SIGUSR1)
    assert wait_ranks(procs, run) == [124, 124]
    preempted_at = (run / "checkpoints" / "latest").read_text()
    assert killed_at < int(preempted_at.removeprefix("step_")) < STEPS

    assert wait_ranks(spawn_ranks(overrides(tiny_data, run), run), run) == [0, 0]  # 3. resumed to the end
    assert records(run) == records(reference)
    assert (run / "checkpoints" / "latest").read_text() == f"step_{STEPS:06d}"
    assert len(list((run / "checkpoints").glob("step_*"))) == 2  # checkpoint.keep


def test_a_longer_run_on_resume_takes_its_schedule_from_the_first_step(tiny_data, tmp_path):
    """Raising train.max_steps on resume stretches the cosine: the first resumed step already runs at the new
    schedule's rate (a scheduler's load restores the saved run's last rate, computed for the old length)."""
    from megatransformer.config import load_config
    from megatransformer.training.optimizers.schedules import lr_multiplier

    run = tmp_path / "run"
    base = [*FOUR_STEPS, f"run_dir={run}", *tiny_data_overrides(tiny_data), "optim.lr=1e-2", "schedule.warmup_steps=1"]
    base += ["train.log_every=1", "train.eval_every=0", "wandb.mode=disabled"]
    train([*base, "train.max_steps=2"], env=ONE_THREAD)
    resumed = train([*base, "train.max_steps=6", "resume=auto"], env=ONE_THREAD)
    rates = {r["step"]: r["lr"] for r in metrics(run) if "lr" in r}
    schedule = lr_multiplier(load_config(str(run / "config.yaml"), []))
    assert schedule(2) != lr_multiplier(load_config(str(run / "config.yaml"), ["train.max_steps=2"]))(2)
    assert [rates[step] for step in (3, 4, 5, 6)] == pytest.approx([1e-2 * schedule(step - 1) for step in (3, 4, 5, 6)])
    assert (
        "resume: the learning-rate schedule differs from the checkpoint's (train.max_steps=6 (2 there)): step 3 "
        f"trains at lr {rates[3]:.4g}, not lr 0.001; the checkpoint's rate had decayed and rises again\n"
        in resumed.stdout
    )
