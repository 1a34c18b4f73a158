"""Muon through DeepSpeed's engine: Newton-Schulz at every ZeRO stage it runs (and a one-line refusal where it
cannot), two data-parallel or tensor-parallel ranks equal to one, a kill -9 resume equal to an uninterrupted run and
continued on another layout,
and a wsd decay branched off a stable checkpoint."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.multiprocessing as mp
from support.models import run_config
from support.runs import checkpoint, losses, losses_by_step, metrics, tiny_run, train, train_command, wait_for_step

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from plan_memory import free_port, host_batch, join  # noqa: E402

STEPS = 3
MATRICES = 7  # one layer: q, k, v, o, gate, up, down
MUON = {"optim.name": "muon", "optim.muon_lr": "0.02", "parallel.zero_stage": "0"}


def _stage_rank(rank: int, ranks: int, port: int, stage: int, precision: str, out: str) -> None:
    from megatransformer.config import ConfigError
    from megatransformer.training.checkpointer import innermost_optimizer
    from megatransformer.training.engine import TrainModule

    cfg = run_config(
        optim={"name": "muon"}, parallel={"zero_stage": stage}, train={"micro_batch_size": 2}, precision=precision
    )
    dist_info = join(rank, ranks, port)
    try:
        module = TrainModule(cfg, dist_info, zero_stage=stage)
    except ConfigError as err:
        seen = {"refused": str(err)}
    else:
        batches = itertools.repeat(host_batch(cfg))
        seen = {"losses": [module.step(batches).loss for _ in range(STEPS)]}
        seen["ns_calls"] = innermost_optimizer(module.engine).ns_calls
    if rank == 0:
        Path(out).write_text(json.dumps(seen))


def stage_run(ranks: int, stage: int, tmp_path: Path, precision: str = "fp32") -> dict:
    out = tmp_path / f"seen_{ranks}_{stage}_{precision}.json"
    mp.spawn(_stage_rank, args=(ranks, free_port(), stage, precision, str(out)), nprocs=ranks)
    return json.loads(out.read_text())


def test_newton_schulz_runs_once_per_matrix_and_step_at_zero_0_and_zero_1_2_3_are_refused(tmp_path):
    one = stage_run(1, 0, tmp_path)
    assert one["ns_calls"] == MATRICES * STEPS
    two = stage_run(2, 0, tmp_path)
    assert two["ns_calls"] == MATRICES * STEPS  # on each rank, on the all-reduced gradients
    assert two["losses"] == pytest.approx(one["losses"], abs=1e-5)
    bf16 = stage_run(1, 0, tmp_path, "bf16")  # (DeepSpeed's unfused bf16 optimizer: fp32 masters as matrices)
    # (which steps the optimizer once with zero gradients as it starts, to create its states: a zero update)
    assert bf16["ns_calls"] == MATRICES * (STEPS + 1)
    assert bf16["losses"] == pytest.approx(one["losses"], rel=2e-2)
    for stage in (1, 2, 3):
        refused = stage_run(2, stage, tmp_path)["refused"]
        assert f"optim.name=muon with parallel.zero_stage={stage}" in refused and "zero_stage=0" in refused


@pytest.mark.parametrize(
    "layout",
    [["parallel.zero_stage=0"], ["parallel.tensor_parallel=2"], ["parallel.sequence_parallel=2"]],
    ids=["dp2", "tp2", "sp2"],
)
def test_two_ranks_train_the_losses_of_one(tiny_data, tmp_path, layout):
    """fp32 Newton-Schulz: in bf16 the gradients' fp32 rounding, which differs by layout, moves a few bf16
    roundings (about 2e-5 of the loss in ten steps)."""
    batch = {"train.global_batch_size": 8, "train.grad_accum": None, "optim.muon_ns_dtype": "fp32"}
    changes = MUON | batch | {"train.max_steps": 10, "checkpoint.every": 100}
    one = train(tiny_run(tiny_data, tmp_path / "one", steps=10, changes=changes))
    assert "optimizer: Muon on 14 matrices" in one.stdout
    train(tiny_run(tiny_data, tmp_path / "two", steps=10, changes=changes) + layout, nproc=2)
    assert losses(tmp_path / "two") == pytest.approx(losses(tmp_path / "one"), abs=1e-5)


def test_kill_9_and_resume_equals_uninterrupted_with_muon(tiny_data, tmp_path):
    reference, crashed = tmp_path / "reference", tmp_path / "crashed"
    changes = MUON | {"schedule.name": "wsd", "checkpoint.every": 5}
    overrides = tiny_run(tiny_data, crashed, steps=20, changes=changes)
    process = subprocess.Popen(
        train_command() + overrides, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    wait_for_step(crashed, 8, [process])
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    train(overrides + ["resume=auto"])
    train(tiny_run(tiny_data, reference, steps=20, changes=changes))
    assert [r["step"] for r in metrics(crashed)] == [r["step"] for r in metrics(reference)]
    assert losses(crashed) == losses(reference)
    # on another layout, with the momentum the checkpoint holds (fp32 Newton-Schulz: tp's reductions round apart)
    fp32 = ["optim.muon_ns_dtype=fp32", "train.max_steps=24", "resume=auto"]
    train(overrides + fp32 + ["parallel.tensor_parallel=2"], nproc=2)
    train(tiny_run(tiny_data, reference, steps=20, changes=changes) + fp32)
    assert losses(crashed)[20:] == pytest.approx(losses(reference)[20:], rel=1e-5)


def test_a_decay_branched_off_a_stable_checkpoint_continues_it_in_its_own_run_dir(tiny_data, tmp_path):
    stable, branch = tmp_path / "stable", tmp_path / "decay"
    wsd = MUON | {"schedule.name": "wsd", "schedule.decay_steps": 4, "checkpoint.every": 6}
    train(tiny_run(tiny_data, stable, steps=12, changes=wsd))
    train(
        tiny_run(tiny_data, branch, steps=9, changes=wsd | {"schedule.decay_steps": None})
        + [f"schedule.decay_from={checkpoint(stable, 6)}", "schedule.decay_shape=linear"]
    )
    ran, base = [r for r in metrics(branch) if r["kind"] == "train"], losses_by_step(stable)
    assert [r["step"] for r in ran] == [7, 8, 9] and not (branch / "checkpoints" / "step_000006").exists()
    assert ran[0]["loss"] == base[7]  # the same weights, optimizer and data as the stable run's step 7
    lrs = [r["lr"] for r in ran]
    assert lrs == pytest.approx([0.02 * (0.1 + 0.9 * f) for f in (2 / 3, 1 / 3, 0.0)])
    assert (stable / "checkpoints" / "step_000012").is_dir()  # the stable run untouched
