"""Sequence parallelism's pieces: each rank's slice of a batch (padding, positions, labels), key/value head
replication, and :class:`UlyssesCore` on 2 gloo ranks against the plain core on one (outputs and gradients) for
every mask: packed documents, prefix-LM, bidirectional, cross-attention of another length, ALiBi, MQA."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from megatransformer.batch import IGNORE_INDEX, PAD_SEGMENT
from megatransformer.model.attention import BACKENDS, flash_attn_module
from megatransformer.model.masks import batch_masks
from megatransformer.model.positions import Alibi, alibi_slopes
from megatransformer.training.sequence_parallel import SequenceShard, local_part, pad_sequences, replicate_kv_heads


def decoder_batch() -> dict[str, torch.Tensor]:
    segments = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 2, 2, 2]])
    return {"input_ids": torch.arange(16).view(2, 8), "segment_ids": segments,
            "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0], [0, 1, 2, 3, 4, 0, 1, 2]]),
            "prefix_len": torch.tensor([[2, 2, 2, 5, 5, 5, 5, 0], [3, 3, 3, 3, 3, 6, 6, 6]]),
            "labels": torch.arange(100, 116).view(2, 8)}


def encoder_decoder_batch() -> dict[str, torch.Tensor]:
    return {"input_ids": torch.arange(8).view(1, 8), "segment_ids": torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2]]),
            "position_ids": torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4]]),
            "decoder_input_ids": torch.tensor([[7, 8, 9, 7, 8]]),
            "decoder_segment_ids": torch.tensor([[1, 1, 2, 2, 2]]),
            "decoder_position_ids": torch.tensor([[0, 1, 0, 1, 2]]), "labels": torch.tensor([[8, 9, 8, 9, 3]])}


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
    batch = {"input_ids": torch.zeros(2, 6, dtype=torch.long), "prefix_len": torch.tensor([2, 3]),
             "labels": torch.zeros(2, 6, dtype=torch.long)}
    assert torch.equal(local_part(batch, 1, 2)["prefix_len"], batch["prefix_len"])
    with pytest.raises(ValueError, match="without segment_ids cannot be padded"):
        pad_sequences(batch, 4)


def test_key_value_heads_fewer_than_ranks_are_repeated_in_order():
    kv = torch.arange(2.0).view(1, 2, 1, 1)
    assert replicate_kv_heads(kv, 4).flatten().tolist() == [0, 0, 1, 1]
    assert replicate_kv_heads(kv, 2) is kv


# ------------------------------------------------------------------------ UlyssesCore on 2 gloo ranks

H, D = 4, 8
SP = 2


def attention_cases() -> dict[str, dict]:
    """name -> the arch, the batch the masks come from, which mask, kv heads, key length, ALiBi."""
    dec, encdec = decoder_batch(), encoder_decoder_batch()
    packed = {k: v for k, v in dec.items() if k != "prefix_len"}
    return {
        "packed causal": dict(arch="decoder", batch=packed, mask="decoder", kv=2),
        "prefix-LM, MQA replicated": dict(arch="decoder", batch=dec, mask="decoder", kv=1),
        "bidirectional packed, ALiBi": dict(arch="encoder", batch=packed, mask="encoder", kv=4, alibi=True),
        "prefix-LM, ALiBi": dict(arch="decoder", batch=dec, mask="decoder", kv=2, alibi=True),
        "cross-attention, other length": dict(arch="encoder_decoder", batch=pad_sequences(encdec, SP), mask="cross",
                                              kv=2),
    }


def _run_rank(rank: int, store: str, backend: str, device: str) -> None:
    """On ``device`` (cpu: gloo, fp32; cuda: NCCL, bf16, one GPU per rank) every case's UlyssesCore against
    the core on the whole sequence; the ranks meet through the file ``store`` (no port to race for)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(SP), LOCAL_RANK=str(rank))
    if device == "cpu":
        os.environ["DS_ACCELERATOR"] = "cpu"
    else:
        torch.cuda.set_device(rank)
    import deepspeed
    import torch.distributed as dist

    from megatransformer.training.sequence_parallel import UlyssesCore

    deepspeed.init_distributed(dist_backend="gloo" if device == "cpu" else "nccl", auto_mpi_discovery=False,
                               init_method=f"file://{store}", rank=rank, world_size=SP)
    dtype, tolerance = (torch.float32, 1e-5) if device == "cpu" else (torch.bfloat16, 2e-2)
    core = BACKENDS[backend]
    ulysses = UlyssesCore(core, dist.group.WORLD, rank, SP)
    for name, case in attention_cases().items():
        batch = case["batch"]
        mask = getattr(batch_masks(case["arch"], batch, varlen=device == "cuda"), case["mask"]).to(device)
        (rows, k_len), q_len = batch["input_ids"].shape, batch["labels"].shape[1]  # (queries: the labels' axis)
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(rows, H, q_len, D, generator=generator)
        k, v = (torch.randn(rows, case["kv"], k_len, D, generator=generator) for _ in range(2))
        weight = torch.randn(q.shape, generator=generator)
        q, k, v, weight = (t.to(device, dtype) for t in (q, k, v, weight))
        alibi = None
        if case.get("alibi"):
            positions = batch["position_ids"].to(device)
            alibi = Alibi(alibi_slopes(H, device), positions, positions)
        expected, expected_grads = _values_and_grads(core, q, k, v, mask, alibi, weight)
        q_part, k_part, v_part, w_part = (_slice(t, rank) for t in (q, k, v, weight))
        local_alibi = None if alibi is None else Alibi(alibi.slopes, _slice(positions, rank, dim=1),
                                                       _slice(positions, rank, dim=1))
        out, grads = _values_and_grads(ulysses, q_part, k_part, v_part, mask, local_alibi, w_part)
        torch.testing.assert_close(out, _slice(expected, rank), atol=tolerance, rtol=tolerance, msg=name)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, _slice(want, rank), atol=tolerance, rtol=tolerance, msg=name)
    dist.destroy_process_group()


def _slice(x: torch.Tensor, rank: int, dim: int = 2) -> torch.Tensor:
    length = x.shape[dim] // SP
    return x.narrow(dim, rank * length, length)


def _values_and_grads(core, q, k, v, mask, alibi, weight):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = core(q, k, v, mask, 0.0, alibi)
    (out * weight).sum().backward()
    return out.detach(), (q.grad, k.grad, v.grad)


@pytest.mark.parametrize("backend", ["sdpa", "chunked"])
def test_ulysses_core_on_two_ranks_equals_the_core_on_one(backend, tmp_path):
    """Each rank's output slice and its gradients with respect to its q, k, v slices are those of the whole
    sequence's attention on one rank (DeepSpeed's all-to-all over gloo, the whole batch's masks)."""
    mp.spawn(_run_rank, args=(str(tmp_path / "store"), backend, "cpu"), nprocs=SP, join=True)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < SP or flash_attn_module() is None,
                    reason=f"needs {SP} CUDA GPUs (NCCL gives each rank its own) and the flash-attn package; CPU "
                           "machines check the same exchange with gloo above")
def test_ulysses_with_flash_attn_on_two_gpus_equals_flash_attn_on_one(tmp_path):
    """flash-attn's varlen problems of the whole batch under Ulysses' all-to-all over NCCL, bf16."""
    mp.spawn(_run_rank, args=(str(tmp_path / "store"), "flash", "cuda"), nprocs=SP, join=True)


# ------------------------------------------------------------------------------- megatransformer info

def info(capsys, *overrides: str) -> dict:
    import json

    from megatransformer.cli import main

    assert main(["info", "--config", "quickstart", "--json", *overrides]) == 0
    return json.loads(capsys.readouterr().out)["layout"]


def test_info_reports_each_sequence_rank_and_activations_shrinking_with_the_degree(capsys):
    one = info(capsys, "data.seq_len=128")
    two = info(capsys, "data.seq_len=128", "parallel.sequence_parallel=2", "--world-size", "4")
    assert two["layout"] == "dp2 x sp2" and one["layout"] == "dp1"
    assert two["sequence_ranks"] == [{"rank": 0, "positions": [0, 63], "attention_heads": [0, 1]},
                                     {"rank": 1, "positions": [64, 127], "attention_heads": [2, 3]}]
    # the same rows, half of each sequence; the exchange hands attention whole-sequence copies of its inputs
    assert two["micro_batch"] == one["micro_batch"]
    assert one["activation_bytes"] / 2 < two["activation_bytes"] < 0.6 * one["activation_bytes"]
    checkpointed = info(capsys, "data.seq_len=128", "model.activation_checkpointing=true")
    assert checkpointed["activation_bytes"] < one["activation_bytes"] / 2


# ------------------------------------------------------------------------------------------ the layout

def test_zero_partitions_over_a_sequence_group_even_with_one_data_parallel_rank():
    from megatransformer.config import validate
    from megatransformer.training.layout import data_parallel_size, describe_layout, engine_zero_stage

    cfg = validate({"parallel": {"zero_stage": 1, "sequence_parallel": 2}, "data": {"seq_len": 64},
                    "model": {"n_heads": 4, "max_seq_len": 64}})
    assert data_parallel_size(cfg, 4) == 2 and describe_layout(2, 1, 2) == "dp2 x sp2"
    assert engine_zero_stage(cfg, 1, "cpu") == 1  # two ranks hold the partitions, not one
    assert engine_zero_stage(validate({"parallel": {"zero_stage": 1}}), 1, "cpu") == 0
