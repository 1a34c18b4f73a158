"""DeepSpeed-Ulysses attention on two ranks (gloo on CPU, NCCL on GPUs) equals the plain core on one: outputs and
q/k/v gradients, for every kind of mask."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from support.ranks import fork_ranks
from support.sequence import decoder_batch, encoder_decoder_batch

from megatransformer.model.attention import BACKENDS, flash_attn_module
from megatransformer.model.masks import batch_masks
from megatransformer.model.positions import Alibi, alibi_slopes
from megatransformer.training.engine.sequence_parallel import pad_sequences
from megatransformer.training.runtime.distributed import teardown

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
        "cross-attention, other length": dict(
            arch="encoder_decoder", batch=pad_sequences(encdec, SP), mask="cross", kv=2
        ),
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

    from megatransformer.training.engine.sequence_parallel import UlyssesCore

    deepspeed.init_distributed(
        dist_backend="gloo" if device == "cpu" else "nccl",
        auto_mpi_discovery=False,
        init_method=f"file://{store}",
        rank=rank,
        world_size=SP,
    )
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
        local_alibi = (
            None
            if alibi is None
            else Alibi(alibi.slopes, _slice(positions, rank, dim=1), _slice(positions, rank, dim=1))
        )
        out, grads = _values_and_grads(ulysses, q_part, k_part, v_part, mask, local_alibi, w_part)
        torch.testing.assert_close(out, _slice(expected, rank), atol=tolerance, rtol=tolerance, msg=name)
        for got, want in zip(grads, expected_grads):
            torch.testing.assert_close(got, _slice(want, rank), atol=tolerance, rtol=tolerance, msg=name)
    teardown()


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
    fork_ranks(_run_rank, (str(tmp_path / "store"), backend, "cpu"), SP)


@pytest.mark.gpu
@pytest.mark.skipif(
    torch.cuda.device_count() < SP or flash_attn_module() is None,
    reason=f"needs {SP} CUDA GPUs (NCCL gives each rank its own) and the flash-attn package; CPU "
    "machines check the same exchange with gloo above",
)
def test_ulysses_with_flash_attn_on_two_gpus_equals_flash_attn_on_one(tmp_path):
    """flash-attn's varlen problems of the whole batch under Ulysses' all-to-all over NCCL, bf16."""
    mp.spawn(_run_rank, args=(str(tmp_path / "store"), "flash", "cuda"), nprocs=SP, join=True)


# ------------------------------------------------------------------------------- megatransformer info
