"""Sequence parallelism's pieces: each rank's slice of a batch (padding, positions, labels), key/value head
replication; the info command's per-rank report; the ZeRO-stage policy (UlyssesCore on two ranks:
tests/e2e/test_ulysses_core.py)."""

from __future__ import annotations

import pytest
import torch
from support.sequence import decoder_batch, encoder_decoder_batch

from megatransformer.batch import IGNORE_INDEX, PAD_SEGMENT
from megatransformer.training.engine.sequence_parallel import (
    SequenceShard,
    local_part,
    pad_sequences,
    replicate_kv_heads,
)


def test_slices_of_a_decoder_batch_put_back_together_make_it():
    batch = decoder_batch()
    parts = [local_part(batch, rank, 4) for rank in range(4)]
    for key, whole in batch.items():
        assert torch.equal(torch.cat([p[key] for p in parts], dim=1), whole), key
    assert parts[1]["position_ids"].tolist() == [[2, 0], [2, 3]]  # whole-sequence positions, not restarted
    assert parts[3]["prefix_len"].tolist() == [[5, 0], [6, 6]]  # prefix ends index the whole row


def test_an_encoder_decoder_target_is_padded_to_the_sequence_parallel_size():
    whole, local = SequenceShard(rank=1, size=2).split(encoder_decoder_batch())
    assert whole["decoder_input_ids"].shape == (1, 6) and whole["input_ids"].shape == (1, 8)
    assert whole["decoder_segment_ids"][0, -1] == PAD_SEGMENT and whole["labels"][0, -1] == IGNORE_INDEX
    assert local["input_ids"].tolist() == [[4, 5, 6, 7]]
    assert local["decoder_input_ids"].tolist() == [[7, 8, 0]] and local["labels"].tolist() == [[9, 3, IGNORE_INDEX]]


def test_one_prefix_per_row_stays_whole_and_a_sequence_without_segments_is_not_padded():
    batch = {
        "input_ids": torch.zeros(2, 6, dtype=torch.long),
        "prefix_len": torch.tensor([2, 3]),
        "labels": torch.zeros(2, 6, dtype=torch.long),
    }
    assert torch.equal(local_part(batch, 1, 2)["prefix_len"], batch["prefix_len"])
    with pytest.raises(ValueError, match="without segment_ids cannot be padded"):
        pad_sequences(batch, 4)


def test_key_value_heads_fewer_than_ranks_are_repeated_in_order():
    kv = torch.arange(2.0).view(1, 2, 1, 1)
    assert replicate_kv_heads(kv, 4).flatten().tolist() == [0, 0, 1, 1]
    assert replicate_kv_heads(kv, 2) is kv


def info(capsys, *overrides: str) -> dict:
    import json

    from megatransformer.cli import main

    assert main(["info", "--config", "quickstart", "--json", *overrides]) == 0
    return json.loads(capsys.readouterr().out)["layout"]


def test_info_reports_each_sequence_rank_and_activations_shrinking_with_the_degree(capsys):
    one = info(capsys, "data.seq_len=128")
    two = info(capsys, "data.seq_len=128", "parallel.sequence_parallel=2", "--world-size", "4")
    assert two["layout"] == "dp2 x sp2" and one["layout"] == "dp1"
    assert two["sequence_ranks"] == [
        {"rank": 0, "positions": [0, 63], "attention_heads": [0, 1]},
        {"rank": 1, "positions": [64, 127], "attention_heads": [2, 3]},
    ]
    # the same rows, half of each sequence; the exchange hands attention whole-sequence copies of its inputs
    assert two["micro_batch"] == one["micro_batch"]
    assert one["activation_bytes"] / 2 < two["activation_bytes"] < 0.6 * one["activation_bytes"]
    checkpointed = info(capsys, "data.seq_len=128", "model.activation_checkpointing=true")
    assert checkpointed["activation_bytes"] < one["activation_bytes"] / 2


# ------------------------------------------------------------------------------------------ the layout


def test_zero_partitions_over_a_sequence_group_even_with_one_data_parallel_rank():
    from megatransformer.config import validate
    from megatransformer.training.runtime.layout import data_parallel_size, describe_layout, engine_zero_stage

    cfg = validate(
        {
            "parallel": {"zero_stage": 1, "sequence_parallel": 2},
            "data": {"seq_len": 64},
            "model": {"n_heads": 4, "max_seq_len": 64},
        }
    )
    assert data_parallel_size(cfg, 4) == 2 and describe_layout(2, 1, 2) == "dp2 x sp2"
    assert engine_zero_stage(cfg, 1, "cpu") == 1  # two ranks hold the partitions, not one
    assert engine_zero_stage(validate({"parallel": {"zero_stage": 1}}), 1, "cpu") == 0
