"""Sequence parallelism (DeepSpeed-Ulysses) end to end: ``parallel.sequence_parallel=2`` on 2 ranks trains every
architecture and objective loss for loss like one rank (fp32, no dropout), with ZeRO-1 and ZeRO-3 (the decoder
with ZeRO-0 and ZeRO-2 too); on 4 ranks, sp4 with a sliding window and dp2 x sp2 (the decoder with its MLPs in
sequence tiles); a checkpoint continues across sp 2 <-> 1; bad layouts exit 2 with one line.

Every run is a real ``megatransformer train`` process (torchrun, gloo) with the same global batch of 4 rows.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from support.runs import SharedRun, checkpoint, losses, metrics, resumable_run, tiny_run, train

STEPS, SAVED = 10, 6

# each architecture and objective, with the positions, key/value heads and options it covers
CASES = {
    "decoder_packed": ["objective=autoregressive"],  # RoPE, 2 kv heads (one per rank)
    "prefix_lm": ["objective=prefix_lm", "model.position=alibi", "model.n_kv_heads=1"],  # kv heads replicated
    "masked_lm": ["objective=masked_lm", "model.arch=encoder", "model.position=learned"],
    # a target length of 29 (padded to 30); cross-attention gathers the encoder's keys and values
    "span_corruption": [
        "objective=span_corruption",
        "model.arch=encoder_decoder",
        "model.position=sinusoidal",
        "data.seq_len=128",
        "model.activation_checkpointing=true",
    ],
}


def overrides(tiny_data, run_dir: Path, case: str, *extra: str) -> list[str]:
    settings = resumable_run(SAVED, micro=2, global_batch=4) | {"checkpoint.keep": 5}
    return [*tiny_run(tiny_data, run_dir, STEPS, settings), *CASES[case], *extra]


@pytest.fixture(scope="module")
def one_rank(tiny_data, tmp_path_factory):
    """The reference run of a case on one rank (made once per case)."""
    runs: dict[str, Path] = {}

    def run(case: str) -> Path:
        if case not in runs:
            runs[case] = tmp_path_factory.mktemp("sp1") / case
            train(overrides(tiny_data, runs[case], case))
        return runs[case]

    return run


@pytest.fixture
def two_sequence_ranks(tiny_data, shared_runs):
    """The run of a case at a ZeRO stage on two sequence-parallel ranks (made once per session)."""

    def run(case: str, zero: int) -> SharedRun:
        sp2 = ("parallel.sequence_parallel=2", f"parallel.zero_stage={zero}")
        return shared_runs.train(lambda run_dir: overrides(tiny_data, run_dir, case, *sp2), nproc=2)

    return run


def grad_norms(run_dir: Path) -> list[float]:
    return [r["grad_norm"] for r in metrics(run_dir) if "grad_norm" in r]


@pytest.mark.parametrize(
    "case, zero", [(case, zero) for case in CASES for zero in (1, 3)] + [("decoder_packed", 0), ("decoder_packed", 2)]
)
def test_two_sequence_ranks_train_like_one_rank(one_rank, two_sequence_ranks, case, zero):
    run, stdout = two_sequence_ranks(case, zero)
    assert "layout: dp1 x sp2 on 2 ranks" in stdout
    assert len(losses(run)) == STEPS
    assert losses(run) == pytest.approx(losses(one_rank(case)), abs=1e-5, rel=0)
    assert grad_norms(run) == pytest.approx(grad_norms(one_rank(case)), rel=1e-4)


def test_four_sequence_ranks_train_like_one_rank_with_a_sliding_window(one_rank, tiny_data, tmp_path):
    """sp=4: one query head per rank, each of the 2 kv heads replicated on two ranks; model.attention_window over
    the whole sequence (each rank's heads see the window across the slices' boundaries), packed documents; the
    final validation too."""
    window = ["model.attention_window=24"]
    reference, run = tmp_path / "sp1", tmp_path / "sp4"
    train(overrides(tiny_data, reference, "decoder_packed", *window))
    result = train(overrides(tiny_data, run, "decoder_packed", "parallel.sequence_parallel=4", *window), nproc=4)
    assert "layout: dp1 x sp4 on 4 ranks" in result.stdout
    assert losses(run) == pytest.approx(losses(reference), abs=1e-5, rel=0)
    assert grad_norms(run) == pytest.approx(grad_norms(reference), rel=1e-4)
    [valid], [valid_reference] = ([r["val_loss"] for r in metrics(d) if "val_loss" in r] for d in (run, reference))
    assert valid == pytest.approx(valid_reference, abs=1e-5, rel=0)
    assert losses(reference)[-1] != pytest.approx(losses(one_rank("decoder_packed"))[-1], abs=1e-3)  # it windows


def test_mlps_in_sequence_tiles_train_like_untiled(one_rank, tiny_data, tmp_path):
    """model.mlp_tiles=2 on each rank's slice, dp2 x sp2 under ZeRO-3 (its gradients reduced once, after the last
    tile, over all four ranks) and activation checkpointing (the tiles recomputed inside a recomputed block)."""
    run = tmp_path / "tiled"
    tiled = ["model.mlp_tiles=2", "model.activation_checkpointing=true", "parallel.zero_stage=3"]
    result = train(overrides(tiny_data, run, "decoder_packed", "parallel.sequence_parallel=2", *tiled), nproc=4)
    assert "layout: dp2 x sp2 on 4 ranks" in result.stdout
    assert losses(run) == pytest.approx(losses(one_rank("decoder_packed")), abs=1e-5, rel=0)
    assert grad_norms(run) == pytest.approx(grad_norms(one_rank("decoder_packed")), rel=1e-4)


# each case at one stage, both stages covered (two ranks run every case at both); the packed decoder's run is
# test_mlps_in_sequence_tiles_train_like_untiled's
@pytest.mark.parametrize("case, zero", [("prefix_lm", 3), ("masked_lm", 1), ("span_corruption", 3)])
def test_data_and_sequence_parallel_on_four_ranks(one_rank, tiny_data, tmp_path, case, zero):
    """dp2 x sp2: two sequence groups read distinct rows, each splits its rows' sequences; ZeRO partitions
    over all four ranks and averages gradients over the two data-parallel groups."""
    run = tmp_path / "dp2sp2"
    result = train(
        overrides(tiny_data, run, case, "parallel.sequence_parallel=2", f"parallel.zero_stage={zero}"), nproc=4
    )
    assert "layout: dp2 x sp2 on 4 ranks" in result.stdout
    assert losses(run) == pytest.approx(losses(one_rank(case)), abs=1e-5, rel=0)
    assert grad_norms(run) == pytest.approx(grad_norms(one_rank(case)), rel=1e-4)


def test_resume_across_sequence_parallel_sizes(one_rank, two_sequence_ranks, tiny_data, tmp_path):
    """A checkpoint written at sp=2 continues at sp=1 and as dp=2 on the same ranks, and one written at sp=1
    continues at sp=2, on the uninterrupted curve (each rank reads its slices of the sharded weights and Adam
    state); at sp=2 again it resumes exactly (each rank its own loader and RNG state)."""
    reference = one_rank("decoder_packed")
    sp2 = two_sequence_ranks("decoder_packed", 1).run_dir
    to_sp1 = tmp_path / "to_sp1"
    result = train(overrides(tiny_data, to_sp1, "decoder_packed", f"resume={checkpoint(sp2, SAVED)}"))
    assert (
        f"resuming step {SAVED} written by 2 ranks (dp1, tp1, sp2, zero1) on 1 rank (dp1, tp1, zero0)" in result.stdout
    )
    to_sp2 = tmp_path / "to_sp2"
    train(
        overrides(
            tiny_data,
            to_sp2,
            "decoder_packed",
            f"resume={checkpoint(reference, SAVED)}",
            "parallel.sequence_parallel=2",
        ),
        nproc=2,
    )
    to_dp2 = tmp_path / "to_dp2"  # the same ranks traded from sequence to data parallelism
    result = train(overrides(tiny_data, to_dp2, "decoder_packed", f"resume={checkpoint(sp2, SAVED)}"), nproc=2)
    assert "written by 2 ranks (dp1, tp1, sp2, zero1) on 2 ranks (dp2, tp1, zero1)" in result.stdout
    exact = tmp_path / "exact"  # the same layout: each rank's own loader and RNG state
    result = train(
        overrides(
            tiny_data, exact, "decoder_packed", f"resume={checkpoint(sp2, SAVED)}", "parallel.sequence_parallel=2"
        ),
        nproc=2,
    )
    assert f"resumed from {checkpoint(sp2, SAVED)} at step {SAVED}" in result.stdout
    for continued in (to_sp1, to_sp2, to_dp2, exact):
        assert losses(continued) == pytest.approx(losses(reference)[SAVED:], abs=1e-5, rel=0)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["parallel.sequence_parallel=3"], "parallel.sequence_parallel=3 does not divide model.n_heads=4"),
        (
            ["parallel.sequence_parallel=2", "parallel.tensor_parallel=2"],
            "parallel.sequence_parallel=2 with parallel.tensor_parallel=2",
        ),
        (
            ["parallel.sequence_parallel=4", "data.seq_len=66"],
            "parallel.sequence_parallel=4 does not divide data.seq_len=66",
        ),
        (
            ["parallel.sequence_parallel=2", "model.d_model=96", "model.n_heads=12", "model.n_kv_heads=3"],
            "parallel.sequence_parallel=2 and model.n_kv_heads=3: one must divide the other",
        ),
        (
            ["parallel.sequence_parallel=2"],
            "parallel.tensor_parallel=1 x parallel.sequence_parallel=2 does not divide the world size 1",
        ),
    ],
)
def test_bad_layouts_exit_2_with_one_line(tiny_data, tmp_path, extra, message):
    result = train(overrides(tiny_data, tmp_path / "bad", "decoder_packed", *extra), expect=2)
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and message in lines[0], result.stderr[-2000:]
    assert "Traceback" not in result.stderr
