"""Elastic resume: a checkpoint continues on another data-parallel size, tensor-parallel size or ZeRO stage,
with the same global batch, as the uninterrupted run would have (fp32, no dropout: loss for loss).

One reference run (2 ranks, ZeRO-1, global batch 8 = micro 4 x dp 2) checkpoints at step 6 and runs to the
end; the checkpoint is resumed in other run directories (``resume=PATH``) on other layouts.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch
from support.runs import checkpoint, losses, losses_by_step, resumable_run, tiny_run, train

from megatransformer.checkpoint.sharded import ShardedState

STEPS, SAVED = 10, 6


def overrides(tiny_data, run_dir: Path, *extra: str) -> list[str]:
    """Global batch 8 of micro batches of 4: the accumulation follows from the data-parallel size."""
    return [*tiny_run(tiny_data, run_dir, STEPS, resumable_run(SAVED, micro=4, global_batch=8)), *extra]


@pytest.fixture(scope="module")
def zero1_dp2(tiny_data, tmp_path_factory) -> Path:
    """The uninterrupted reference: 2 data-parallel ranks, ZeRO-1 (and its checkpoint at step SAVED)."""
    run = tmp_path_factory.mktemp("elastic") / "zero1_dp2"
    train(overrides(tiny_data, run, "parallel.zero_stage=1", "checkpoint.keep=5"), nproc=2)
    return run


def resume(tiny_data, source: Path, run_dir: Path, nproc: int, *extra: str, expect: int = 0):
    return train(
        overrides(tiny_data, run_dir, f"resume={checkpoint(source, SAVED)}", *extra), nproc=nproc, expect=expect
    )


def test_the_checkpoint_holds_masters_and_both_moments_once_across_the_ranks(zero1_dp2):
    """Each rank's shard holds its ZeRO partition of the fp32 weights and of both Adam moments; together the
    pieces cover every element of every parameter once (12 bytes a parameter, and little beside), with the
    step count and the schedule in the index; every shard is listed in the manifest."""
    path = checkpoint(zero1_dp2, SAVED)
    state = ShardedState(path)
    assert state.kinds == ["fp32", "exp_avg", "exp_avg_sq"]
    files = {piece.file for layout in state.params.values() for piece in layout.pieces}
    assert files == {"shard_00000.safetensors", "shard_00001.safetensors"}
    manifest = json.loads((path / "COMPLETE").read_text())["files"]
    assert files <= set(manifest)
    params = sum(math.prod(layout.shape) for layout in state.params.values())
    shards = sum(manifest[f]["size"] for f in files)
    assert 12 * params <= shards <= 1.05 * 12 * params
    moment = state.tensor(next(iter(state.params)), "exp_avg_sq")
    assert moment.dtype == torch.float32 and moment.abs().sum() > 0
    optimizer = json.loads((path / "index.json").read_text())["optimizer"]
    assert optimizer["step"] == SAVED and optimizer["lr_scheduler"]["last_epoch"] == SAVED
    assert not [name for name in manifest if name.endswith(("_states.pt", "model.safetensors"))]


def test_two_ranks_resume_on_one_rank_loss_for_loss(zero1_dp2, tiny_data, tmp_path):
    run = tmp_path / "dp1"
    result = resume(tiny_data, zero1_dp2, run, 1, "parallel.zero_stage=1")
    # (ZeRO-1 over one data-parallel rank partitions nothing: the engine runs stage 0, and says so)
    assert "parallel.zero_stage=1 on one data-parallel rank: nothing to partition" in result.stdout
    assert (
        f"resuming step {SAVED} written by 2 ranks (dp2, tp1, zero1) on 1 rank (dp1, tp1, zero0): "
        "micro 4 x accum 2 (was micro 4 x accum 1)"
    ) in result.stdout
    assert json.loads((checkpoint(run, STEPS) / "trainer.json").read_text())["zero_stage"] == 0
    continued = losses(run)
    assert len(continued) == STEPS - SAVED
    assert continued == pytest.approx(losses(zero1_dp2)[SAVED:], abs=1e-5, rel=0)


def test_a_shard_only_rank_1_reads_is_refused_on_both_ranks(zero1_dp2, tiny_data, tmp_path):
    """Bytes flipped in shard_00001 of the last checkpoint, which on the saved layout only rank 1 reads (its ZeRO-1
    partition) and only rank 1 hashes: both ranks refuse it together. resume=PATH exits 2 naming it; resume=auto
    goes back to the checkpoint before on both ranks and continues loss for loss."""
    run = Path(shutil.copytree(zero1_dp2, tmp_path / "run"))
    last = checkpoint(run, STEPS)
    data = bytearray((last / "shard_00001.safetensors").read_bytes())
    data[-64:] = bytes(b ^ 0x5A for b in data[-64:])
    (last / "shard_00001.safetensors").write_bytes(bytes(data))
    refused = train(
        overrides(tiny_data, tmp_path / "other", f"resume={last}", "parallel.zero_stage=1"), nproc=2, expect=None
    )
    # (torchrun exits 1 when a rank fails; the ranks exit 2, as a bad config's error, not stalled in a collective)
    assert refused.returncode != 0 and re.search(r"exitcode\s*:\s*2\b", refused.stderr), refused.stderr[-3000:]
    errors = [line for line in refused.stderr.splitlines() if line.startswith("megatransformer train: error:")]
    assert errors and all("shard_00001.safetensors: changed since the save" in line for line in errors), errors
    resumed = train(overrides(tiny_data, run, "resume=auto", "parallel.zero_stage=1"), nproc=2)
    assert f"resumed from {checkpoint(run, SAVED)} at step {SAVED}" in resumed.stdout
    assert "shard_00001.safetensors: changed since the save" in resumed.stderr
    assert losses_by_step(run) == losses_by_step(zero1_dp2)


def test_zero1_resumes_as_zero3_and_zero0(zero1_dp2, tiny_data, tmp_path):
    """Another ZeRO stage on the same ranks (partitioned parameters; and no partitioning at all, where the
    Adam state lives in the torch optimizer)."""
    for stage in (3, 0):
        run = tmp_path / f"zero{stage}"
        result = resume(tiny_data, zero1_dp2, run, 2, f"parallel.zero_stage={stage}")
        assert f"on 2 ranks (dp2, tp1, zero{stage})" in result.stdout
        assert losses(run) == pytest.approx(losses(zero1_dp2)[SAVED:], rel=1e-5), f"ZeRO-{stage}"


def test_four_ranks_resume_on_two_and_two_on_four(zero1_dp2, tiny_data, tmp_path):
    """dp4 ZeRO-2 (micro 2) resumed as dp2 ZeRO-1 (micro 4), and the reference dp2 ZeRO-1 resumed as dp4 ZeRO-2:
    each continues loss for loss, every rank reading only the slices it holds of the other layout's shards."""
    four, two, back = tmp_path / "dp4", tmp_path / "dp2", tmp_path / "back"
    train(overrides(tiny_data, four, "parallel.zero_stage=2", "train.micro_batch_size=2"), nproc=4)
    assert len(list(checkpoint(four, SAVED).glob("shard_*"))) == 4
    result = resume(tiny_data, four, two, 2, "parallel.zero_stage=1")
    assert "written by 4 ranks (dp4, tp1, zero2) on 2 ranks (dp2, tp1, zero1)" in result.stdout
    assert losses(two) == pytest.approx(losses(four)[SAVED:], abs=1e-5, rel=0)
    result = resume(tiny_data, zero1_dp2, back, 4, "parallel.zero_stage=2", "train.micro_batch_size=2")
    assert "written by 2 ranks (dp2, tp1, zero1) on 4 ranks (dp4, tp1, zero2)" in result.stdout
    assert losses(back) == pytest.approx(losses(zero1_dp2)[SAVED:], abs=1e-5, rel=0)


def test_tensor_parallel_two_resumes_on_one_rank(tiny_data, tmp_path):
    """TP2 -> TP1: the tensor-parallel shards of the masters and moments are whole in the checkpoint and
    split again (here: not at all) for the new layout; within the TP parity test's tolerance."""
    tp2, tp1 = tmp_path / "tp2", tmp_path / "tp1"
    train(overrides(tiny_data, tp2, "parallel.tensor_parallel=2", "parallel.zero_stage=1"), nproc=2)
    result = resume(tiny_data, tp2, tp1, 1, "parallel.zero_stage=1")
    assert "written by 2 ranks (dp1, tp2, zero0) on 1 rank (dp1, tp1, zero0)" in result.stdout
    assert losses(tp1) == pytest.approx(losses(tp2)[SAVED:], rel=1e-5)


def test_another_global_batch_is_refused_unless_allowed(zero1_dp2, tiny_data, tmp_path):
    run = tmp_path / "smaller"
    smaller = ("train.global_batch_size=4", "parallel.zero_stage=1")
    refused = resume(tiny_data, zero1_dp2, run, 1, *smaller, expect=2)
    message = [line for line in refused.stderr.splitlines() if "error" in line]  # (as test_training's)
    assert "Traceback" not in refused.stderr
    assert len(message) == 1 and "global batch 8" in message[0] and "resume_elastic=allow_batch_change" in message[0]
    assert not (run / "metrics.jsonl").exists()
    allowed = resume(tiny_data, zero1_dp2, run, 1, *smaller, "resume_elastic=allow_batch_change")
    assert "global batch 8 -> 4" in allowed.stdout and "not an exact continuation" in allowed.stdout
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == list(range(SAVED + 1, STEPS + 1))
    # the data goes on from the global row the checkpoint reached, 4 rows (of 64 positions) a step
    assert steps[-1]["tokens"] - steps[0]["tokens"] == (STEPS - SAVED - 1) * 4 * 64


@pytest.mark.parametrize("source,target", [(1, 0), (0, 1)])
def test_bf16_masters_and_moments_move_between_zero0_and_zero1(tiny_data, tmp_path, source, target):
    """bf16 keeps fp32 masters apart from the bf16 weights, in DeepSpeed's bf16 optimizer (ZeRO-1) or its
    FP16_Optimizer (ZeRO-0). One step after a resume on the other one (and one rank), the masters and
    moments are those of the uninterrupted run: much closer than the bf16 weights (masters rebuilt from
    them would be off by bf16 rounding, ~1e-3 of each weight)."""
    ref, run = tmp_path / "ref", tmp_path / "resumed"
    bf16 = ("precision=bf16", f"train.max_steps={SAVED + 1}")
    train(overrides(tiny_data, ref, *bf16, f"parallel.zero_stage={source}"), nproc=2)
    resume(tiny_data, ref, run, 1, *bf16, f"parallel.zero_stage={target}")
    step = f"step_{SAVED + 1:06d}"
    expected, got = ShardedState(ref / "checkpoints" / step), ShardedState(run / "checkpoints" / step)
    assert expected.params.keys() == got.params.keys() and expected.kinds == got.kinds
    for kind in expected.kinds:
        for key in expected.params:
            value = expected.tensor(key, kind)
            diff = (got.tensor(key, kind) - value).abs().mean()
            if kind == "fp32":  # masters: far below the bf16 rounding (~1e-5 here; ~3e-8 measured)
                assert diff < (value - value.bfloat16().float()).abs().mean() / 20, key
            else:  # moments: as close as one bf16 step on another layout allows (~3e-4 relative measured)
                assert diff < 1e-2 * value.abs().mean(), key


def test_one_rank_resumes_on_two_with_its_global_batch_and_validation_rows(tiny_data, tmp_path):
    """A config that fixes the micro batch (micro 4 x accum 2: global 8 on one rank, 16 on two) resumed on two
    ranks without overrides: the checkpoint's global batch is kept (micro 4 x accum 1 there), said in one line,
    and the run continues loss for loss; validation reads the same rows (the same tokens, the same loss)."""
    one, two = tmp_path / "one", tmp_path / "two"
    settings = tiny_run(tiny_data, one, STEPS, {"checkpoint.every": SAVED, "train.eval_every": SAVED})
    train(settings)
    result = train(
        [
            *tiny_run(tiny_data, two, STEPS, {"checkpoint.every": SAVED, "train.eval_every": SAVED}),
            f"resume={checkpoint(one, SAVED)}",
        ],
        nproc=2,
    )
    kept = [line for line in result.stdout.splitlines() if line.startswith("resume: keeping")]
    assert kept == [
        "resume: keeping the checkpoint's global batch 8 on 2 data-parallel ranks: micro 4 x accum 1 (the config's "
        "micro 4 x accum 2 would make it 16; validation stays 8 rows; resume_elastic=allow_batch_change trains "
        "with the config's batch instead)"
    ]
    records = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    reference = [json.loads(line) for line in (one / "metrics.jsonl").read_text().splitlines()]
    tokens = [r["tokens"] for r in records if "loss" in r]
    assert tokens == [r["tokens"] for r in reference if "loss" in r][SAVED:]
    assert losses(two) == pytest.approx(losses(one)[SAVED:], abs=1e-5, rel=0)
    (val_two,), val_one = [r for r in records if "val_loss" in r], [r for r in reference if "val_loss" in r]
    assert val_two["val_tokens"] == val_one[-1]["val_tokens"]
    assert val_two["val_loss"] == pytest.approx(val_one[-1]["val_loss"], abs=1e-5)
