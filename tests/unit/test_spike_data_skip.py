"""Skipped global row ranges in the streaming loader: the rows are read but not handed out, on any number of
ranks and workers, and the ranges travel with the loader state (exact and elastic resume)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from support import data
from support.data import loader_config

from data_pipeline.loader import merge_states
from megatransformer.training.data import build_run_loader

make_cfg = functools.partial(loader_config, seq_len=32, seed=7, max_seq_len=64)


def global_rows(cfg, tok, dp_size: int, micro: int, steps: int, skip=None, states=None) -> list[torch.Tensor]:
    """The rows of ``steps`` global batches, in global row order (rank r's local row i is row r + dp*i)."""
    return data.global_rows(rank_loaders(cfg, tok, dp_size, micro, skip, states), steps * micro, "input_ids")


def rank_loaders(cfg, tok, dp_size: int, micro: int, skip=None, states=None):
    """Each rank's loader, in turn, with ``states`` loaded and ``skip`` rows skipped."""
    for rank in range(dp_size):
        loader = build_run_loader(cfg, "train", micro, rank, dp_size, tok)
        if states is not None:
            loader.load_state_dict(states)
        if skip is not None:
            loader.skip_rows(*skip)
        yield loader


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("dp_size,workers", [(1, 0), (2, 0), (2, 2)])
def test_skipped_rows_are_left_out_of_the_global_sequence(tiny_data, tok, dp_size, workers):
    cfg = make_cfg(tiny_data, num_workers=workers)
    plain = global_rows(cfg, tok, dp_size, 2, 24)
    skipped = global_rows(cfg, tok, dp_size, 2, 6, skip=(8, 32))
    assert same(skipped, plain[:8] + plain[32 : 32 + len(skipped) - 8])


def test_a_range_is_widened_to_whole_micro_batches_of_every_rank(tiny_data, tok):
    cfg = make_cfg(tiny_data)
    loader = build_run_loader(cfg, "train", 2, 1, 2, tok)
    loader.skip_rows(5, 9)
    loader.skip_rows(12, 13)
    loader.skip_rows(0, 0)
    assert loader.skip == [(4, 16)]  # [4, 12) and [12, 16), joined


def test_skipped_ranges_resume_exactly_and_elastically(tiny_data, tok):
    cfg = make_cfg(tiny_data)
    reference = global_rows(cfg, tok, 2, 2, 10, skip=(8, 24))
    loaders = [build_run_loader(cfg, "train", 2, rank, 2, tok) for rank in range(2)]
    for loader in loaders:
        loader.skip_rows(8, 24)
        for _, _ in zip(range(3), loader):  # 3 batches of 2 rows each: rows 0-7 and 24-27 consumed
            pass
    states = [json.loads(json.dumps(loader.state_dict())) for loader in loaders]
    assert all(state["skip_rows"] == [[8, 24]] for state in states)
    exact = build_run_loader(cfg, "train", 2, 0, 2, tok)  # rank 0 resumed from its own state
    exact.load_state_dict(states[0])
    rows = [row for _, batch in zip(range(3), exact) for row in batch["input_ids"]]
    assert same(rows, reference[12::2][:6])
    merged = merge_states(states)
    assert merged["skip_rows"] == [[8, 24]]
    one_rank = global_rows(cfg, tok, 1, 4, 7, states=merged)  # elastic: one rank continues both
    assert same(one_rank, reference[12 : 12 + len(one_rank)])


def test_inspect_shows_the_documents_behind_a_global_row_range(tmp_path, tiny_data, tok, capsys):
    from megatransformer.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"vocab_size": 512, "max_seq_len": 64, "d_model": 32, "n_heads": 2},
                "data": {
                    "train": str(tiny_data.shards),
                    "tokenizer": str(tiny_data.tokenizer),
                    "seq_len": 32,
                    "num_workers": 2,
                },
                "seed": 7,
            }
        )
    )
    assert main(["data", "inspect", "--config", str(config), "--rows", "5:8"]) == 0
    shown = capsys.readouterr().out
    assert [line for line in shown.splitlines() if line.startswith("row ")] == ["row 5:", "row 6:", "row 7:"]
    expected = global_rows(make_cfg(tiny_data), tok, 2, 2, 2)[5:8]  # the rows two ranks train on
    for row in expected:
        assert repr(tok.decode(row.tolist())) in shown
    with pytest.raises(SystemExit) as refused:
        main(["data", "inspect", "--config", str(config), "--rows", "8:5"])
    assert refused.value.code == 2
    assert "START:STOP" in capsys.readouterr().err
