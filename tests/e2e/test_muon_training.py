"""Muon through DeepSpeed's engine: Newton-Schulz at every ZeRO stage (and a one-line refusal where it cannot run),
two data-parallel (ZeRO-0 to 3), tensor-parallel or sequence-parallel ranks equal to one (with matrices split across
teams of ranks), a kill -9 resume equal to
an uninterrupted run and continued on another layout, a ZeRO run resumed on other stages, and a wsd decay branched
off a stable checkpoint."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from support.models import run_config
from support.ranks import fork_ranks
from support.runs import checkpoint, losses, losses_by_step, metrics, tiny_run, train, train_command, wait_for_step

from megatransformer.flops import BALANCE

sys.path.insert(0, str(Path(__file__).parents[2] / "bench"))
from plan_memory import free_port, host_batch, join  # noqa: E402

STEPS = 3
MATRICES = 7  # one layer: q, k, v, o, gate, up, down
# d_ff 192: the 192 x 32 gate, up and down cost 4.3x q or o, so that teams balance them (flops.balance_teams): over 2
# ranks gate (tall) split in two; over 4, gate and up across three (a block across the two tensor-parallel shards)
# and down (wide: strided blocks) across all four. Tensor-parallel 2 steps the matrices split by rows (q, k, v, gate,
# up) and by columns (o, down) as two groups, one exchange each, each balanced on its own: q, gate and up across two,
# down across three
MODEL = dict(d_model=32, n_layers=1, n_heads=4, n_kv_heads=2, d_ff=192, vocab_size=128, max_seq_len=32)
TEAMS = {  # by world size and tensor-parallel degree: matrices split, team members' parts (of all split matrices) a
    # step, the owner line's words
    (2, 1): (1, 2, ", 1 of them split by columns across teams of 2 ranks"),
    (4, 1): (3, 3 + 3 + 4, ", 3 of them split by columns across teams of 3 to 4 ranks"),
    (4, 2): (
        4,
        2 + 2 + 2 + 3,
        ", 4 of them split by columns across teams of 2 to 3 ranks, balanced within each of 2 step units (stepped one "
        "after another)",
    ),
}
MUON = {"optim.name": "muon", "optim.muon_lr": "0.02", "parallel.zero_stage": "0"}


def _stage_rank(rank: int, ranks: int, port: int, stage: int, precision: str, parallel: dict, out: str) -> None:
    from megatransformer.config import ConfigError
    from megatransformer.planner import muon_elements
    from megatransformer.training.checkpointing.checkpointer import innermost_optimizer, local_fragments
    from megatransformer.training.engine.train_module import TrainModule
    from megatransformer.training.runtime.distributed import teardown

    cfg = run_config(
        model=MODEL,
        optim={"name": "muon", "muon_ns_dtype": "bf16" if precision == "bf16" else "fp32"},
        parallel={"zero_stage": stage, **parallel},
        train={"micro_batch_size": 2},
        precision=precision,
    )
    dist_info = join(rank, ranks, port)
    try:
        module = TrainModule(cfg, dist_info, zero_stage=stage)
    except ConfigError as err:
        seen = {"refused": str(err)}
    else:
        batches = itertools.repeat(host_batch(cfg))
        seen = {"losses": [module.step(batches).loss for _ in range(STEPS)]}
        optimizer = innermost_optimizer(module.engine)
        seen |= {"ns_calls": optimizer.ns_calls, "ns_parts": optimizer.ns_parts, "ns_flops": optimizer.ns_flops}
        seen["owners"] = module.muon_owner_line
        seen["wrapper"] = type(module.engine.optimizer).__name__
        # what a checkpoint saves: this rank's part of each matrix's momentum, no Adam moments
        fragments = local_fragments(module.engine, module.partitions, module.tp)
        held = [f for f in fragments if f.name.endswith("proj.weight")]
        seen["momentum"] = sum(f.view("momentum_buffer").numel() for f in held)
        seen["adam_moments"] = [f.name for f in held if f.view("exp_avg") is not None]
        seen["matrices"] = muon_elements(cfg.model, module.tp)
        module.close()
    teardown()
    Path(f"{out}.{rank}").write_text(json.dumps(seen))


def stage_run(ranks: int, stage: int, tmp_path: Path, precision: str = "fp32", **parallel) -> list[dict]:
    """What each rank saw (its losses, Newton-Schulz work and momentum), or the refusal; ``parallel``: other
    settings of the parallel section."""
    out = tmp_path / f"seen_{ranks}_{stage}_{precision}_{'_'.join(map(str, parallel.values()))}.json"
    fork_ranks(_stage_rank, (ranks, free_port(), stage, precision, parallel, str(out)), ranks)
    return [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(ranks)]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> dict:
    """What one fp32 rank at ZeRO-0 saw: the reference of the other layouts."""
    (one,) = stage_run(1, 0, tmp_path_factory.mktemp("muon_one_rank"))
    return one


def _orthogonalised_once(one_rank: dict, ranks: list[dict], tp: int = 1) -> None:
    """Newton-Schulz's FLOPs summed over the ranks are one rank's (each matrix orthogonalised once: whole at its
    owner, or a part at each member of its team), every rank does some, and the teams split what they should."""
    world = len(ranks)
    split, parts, words = TEAMS[world, tp]
    assert all(r["owners"] == ranks[0]["owners"] for r in ranks)
    assert f"by one of {world} ranks{words} (max/mean" in ranks[0]["owners"]
    assert sum(r["ns_calls"] for r in ranks) == (MATRICES - split) * STEPS
    assert sum(r["ns_parts"] for r in ranks) == parts * STEPS
    assert min(r["ns_flops"] for r in ranks) > 0 and sum(r["ns_flops"] for r in ranks) == one_rank["ns_flops"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_each_matrix_is_orthogonalised_once_over_two_ranks_which_train_the_losses_of_one(one_rank, tmp_path, stage):
    """fp32 Newton-Schulz (bf16's roundings would hide a small difference); ZeRO's reductions round alike here.
    Each matrix has one owner rank, or a team (the gate projection, split by columns across both ranks): the
    Newton-Schulz FLOPs of both ranks add up to one rank's."""
    assert one_rank["ns_calls"] == MATRICES * STEPS and one_rank["ns_parts"] == 0
    assert one_rank["owners"].startswith(f"Muon owners: each of {MATRICES} matrices orthogonalised once, by one of 1")
    wrapper = {0: "MuonWithAdamW", 3: "DeepSpeedZeroOptimizer_Stage3"}.get(stage, "DeepSpeedZeroOptimizer")
    ranks = stage_run(2, stage, tmp_path)
    assert all(r["wrapper"] == wrapper and r["losses"] == pytest.approx(one_rank["losses"], abs=1e-5) for r in ranks)
    _orthogonalised_once(one_rank, ranks)
    if stage:  # the momentum partitioned: each element in one rank's partition
        assert 0 < ranks[0]["momentum"] < ranks[0]["matrices"] == sum(r["momentum"] for r in ranks)
    assert not any(r["adam_moments"] for r in ranks)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_tensor_parallel_two_over_two_data_parallel_ranks_equals_one_rank(one_rank, tmp_path, stage):
    """Four ranks: each matrix's elements, from both tensor-parallel shards, gathered at its one owner, or each
    member's columns at the member (four matrices split, across teams of 2 and 3)."""
    ranks = stage_run(4, stage, tmp_path, tensor_parallel=2)
    assert all(r["losses"] == pytest.approx(one_rank["losses"], abs=1e-5) for r in ranks)
    _orthogonalised_once(one_rank, ranks, tp=2)


def test_four_data_parallel_ranks_at_zero_3_equal_one_rank(one_rank, tmp_path):
    ranks = stage_run(4, 3, tmp_path)
    assert all(r["losses"] == pytest.approx(one_rank["losses"], abs=1e-5) for r in ranks)
    _orthogonalised_once(one_rank, ranks)


def test_bf16_muon_runs_at_every_stage(one_rank, tmp_path):
    """DeepSpeed's unfused bf16 optimizer at ZeRO-0 (fp32 masters as matrices, stepped once with zero gradients as
    it starts: a zero update), its BF16_Optimizer at ZeRO-1 and ZeRO-2/3's fp32 partitions."""
    (zero_0,) = stage_run(1, 0, tmp_path, "bf16")
    assert zero_0["ns_calls"] == MATRICES * (STEPS + 1)
    assert zero_0["losses"] == pytest.approx(one_rank["losses"], rel=2e-2)
    wrappers = {1: "BF16_Optimizer", 2: "DeepSpeedZeroOptimizer", 3: "DeepSpeedZeroOptimizer_Stage3"}
    for stage, wrapper in wrappers.items():
        first, second = stage_run(2, stage, tmp_path, "bf16")
        assert first["wrapper"] == wrapper and first["losses"] == second["losses"]
        assert first["losses"] == pytest.approx(zero_0["losses"], rel=2e-2)


def test_an_offloaded_optimizer_is_refused(tmp_path):
    refused = stage_run(2, 2, tmp_path, offload_optimizer=True)[0]["refused"]
    assert "optim.name=muon with parallel.offload_optimizer=true" in refused


@pytest.mark.parametrize(
    "layout",
    [
        ["parallel.zero_stage=0"],
        ["parallel.zero_stage=1"],
        ["parallel.zero_stage=2"],
        ["parallel.zero_stage=3"],
        ["parallel.tensor_parallel=2"],
        ["parallel.sequence_parallel=2"],
        ["parallel.sequence_parallel=2", "parallel.zero_stage=1"],
        ["parallel.sequence_parallel=2", "parallel.zero_stage=3"],
    ],
    ids=["dp2", "dp2-zero1", "dp2-zero2", "dp2-zero3", "tp2", "sp2", "sp2-zero1", "sp2-zero3"],
)
def test_two_ranks_train_the_losses_of_one(tiny_data, shared_runs, tmp_path, layout):
    """fp32 Newton-Schulz: in bf16 the gradients' fp32 rounding, which differs by layout, moves a few bf16
    roundings (about 2e-5 of the loss in ten steps)."""
    batch = {"train.global_batch_size": 8, "train.grad_accum": None, "optim.muon_ns_dtype": "fp32"}
    changes = MUON | batch | {"train.max_steps": 10, "checkpoint.every": 100}
    one = shared_runs.train(lambda run_dir: tiny_run(tiny_data, run_dir, steps=10, changes=changes))
    assert "optimizer: Muon on 14 matrices" in one.stdout
    two = train(tiny_run(tiny_data, tmp_path / "two", steps=10, changes=changes) + layout, nproc=2)
    (owners,) = [line for line in two.stdout.splitlines() if line.startswith("Muon owners:")]
    assert "each of 14 matrices orthogonalised once, by one of 2 ranks" in owners
    if any("zero_stage=3" in change or "tensor_parallel" in change for change in layout):
        # (a ZeRO-3 sub-group a layer, or tensor parallelism's two groups: each balanced on its own)
        assert "balanced within each of 2 step units (stepped one after another) (max/mean" in owners
        assert float(re.search(r"max/mean Newton-Schulz FLOPs ([\d.]+)", owners)[1]) <= BALANCE
    else:
        assert owners.endswith("per rank, matrices/FLOPs: 7/50.0% 7/50.0%")
    assert losses(tmp_path / "two") == pytest.approx(losses(one.run_dir), abs=1e-5)


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


def test_a_zero_run_resumes_on_other_zero_stages_with_the_momentum_it_saved(tiny_data, tmp_path):
    """ZeRO-1 on two ranks saves each matrix's momentum from its partitions; ZeRO-3 on two ranks, then ZeRO-0 on
    one, continue it as a one-rank run continues itself (fp32 Newton-Schulz: the layouts' reductions round apart)."""
    zero, reference = tmp_path / "zero", tmp_path / "reference"
    changes = MUON | {"train.global_batch_size": 8, "train.grad_accum": None, "optim.muon_ns_dtype": "fp32"}
    changes |= {"checkpoint.every": 3}
    layouts = [(["parallel.zero_stage=1"], 2), (["parallel.zero_stage=3"], 2), (["parallel.zero_stage=0"], 1)]
    for i, (layout, nproc) in enumerate(layouts):
        resume = ["resume=auto"] if i else []
        train(tiny_run(tiny_data, zero, steps=3 * (i + 2), changes=changes) + layout + resume, nproc=nproc)
        train(tiny_run(tiny_data, reference, steps=3 * (i + 2), changes=changes) + resume)
        assert losses(zero) == pytest.approx(losses(reference), abs=1e-5)
        index = json.loads((checkpoint(zero, 3 * (i + 2)) / "index.json").read_text())
        kinds = {name: tuple(p["kinds"]) for name, p in index["params"].items()}
        matrices = [name for name in kinds if name.endswith("proj.weight")]
        assert len(matrices) == 14 and {kinds[name] for name in matrices} == {("fp32", "momentum_buffer")}
        assert {kinds[name] for name in kinds if name not in matrices} == {("fp32", "exp_avg", "exp_avg_sq")}
    assert [r["step"] for r in metrics(zero) if r["kind"] == "train"] == list(range(1, 13))


def test_a_decay_branched_off_a_stable_checkpoint_continues_it_in_its_own_run_dir(tiny_data, tmp_path):
    stable, branch = tmp_path / "stable", tmp_path / "decay"
    wsd = MUON | {"schedule.name": "wsd", "schedule.decay_steps": 4, "checkpoint.every": 6}
    wsd |= {"train.cpu_bf16_matmul": "fp32"}  # (Newton-Schulz in bf16, as fp32 GEMMs: the model's are fp32)
    train(tiny_run(tiny_data, stable, steps=12, changes=wsd))
    decay = tiny_run(tiny_data, branch, steps=9, changes=wsd | {"schedule.decay_steps": None})
    # (the stable run's last checkpoint has decayed: a branch of it raised the rate 5.5x and decayed again)
    refused = train(decay + [f"schedule.decay_from={stable}", "schedule.decay_shape=linear"], expect=2)
    assert "is at step 12 of a wsd schedule, in its decay" in refused.stderr
    result = train(decay + [f"schedule.decay_from={checkpoint(stable, 6)}", "schedule.decay_shape=linear"])
    assert "decaying from step 6, lr 0.003, muon_lr 0.02, to step 9, lr 0.0003, muon_lr 0.002, linear" in result.stdout
    assert "Muon's bf16 Newton-Schulz: fp32 GEMMs of the bf16 operands; train.cpu_bf16_matmul=fp32" in result.stdout
    assert "bf16 matmuls:" not in result.stdout
    ran, base = [r for r in metrics(branch) if r["kind"] == "train"], losses_by_step(stable)
    assert [r["step"] for r in ran] == [7, 8, 9] and not (branch / "checkpoints" / "step_000006").exists()
    assert ran[0]["loss"] == base[7]  # the same weights, optimizer and data as the stable run's step 7
    lrs = [r["lr"] for r in ran]
    assert lrs == pytest.approx([0.02 * (0.1 + 0.9 * f) for f in (2 / 3, 1 / 3, 0.0)])
    assert (stable / "checkpoints" / "step_000012").is_dir()  # the stable run untouched
