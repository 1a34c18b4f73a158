"""Attention inputs and masks for comparing an attention core with ``eager``: B rows of T positions, H query
heads over KV key/value heads of D dimensions; packed rows, padding and prefixes."""

from __future__ import annotations

import pytest
import torch

from megatransformer.batch import PAD_SEGMENT
from megatransformer.config import ModelConfig
from megatransformer.model import attention
from megatransformer.model.masks import AttentionMask, self_attention_mask
from support.models import tiny_config

B, H, KV, T, D = 2, 4, 2, 19, 8


def rows(*segment_rows: list[int]) -> torch.Tensor:
    """Segment ids from run lengths per row: rows([3, 2], [5]) -> [[1,1,1,2,2], [1,1,1,1,1]] (0 pads)."""
    out = torch.zeros(len(segment_rows), T, dtype=torch.long)
    for r, lengths in enumerate(segment_rows):
        at = 0
        for index, n in enumerate(lengths):
            out[r, at : at + n] = index + 1 if n > 0 else 0
            at += abs(n)
    return out


PACKED = rows([5, 6, 3, -5], [7, 12])  # row 0 ends in 5 padding positions
LEADING_PAD = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2, 0, 0, 3, 3, 3, 3, 3, 3, 0, 0]]).expand(B, -1).contiguous()


def per_document_prefix(segments: torch.Tensor, prefix: list[list[int]]) -> torch.Tensor:
    """[B, T] prefix ends: document k of row b has a prefix of prefix[b][k] tokens (0 for padding)."""
    ends = torch.zeros_like(segments)
    for b in range(segments.shape[0]):
        for k, length in enumerate(prefix[b]):
            where = (segments[b] == k + 1).nonzero().flatten()
            if len(where):
                ends[b, where] = int(where[0]) + length
    return ends


SELF_MASKS = {
    "causal": lambda: self_attention_mask(True),
    "bidirectional": lambda: self_attention_mask(False),
    "prefix_per_row": lambda: self_attention_mask(True, prefix_len=torch.tensor([3, 11])),
    "prefix_whole_row": lambda: self_attention_mask(True, prefix_len=torch.tensor([T, 0])),
    "packed_causal": lambda: self_attention_mask(True, PACKED),
    "packed_bidirectional": lambda: self_attention_mask(False, PACKED),
    "padding_inside": lambda: self_attention_mask(True, LEADING_PAD),
    "packed_prefix_per_row": lambda: self_attention_mask(True, PACKED, torch.tensor([4, 9])),
    "packed_prefix_per_document": lambda: self_attention_mask(
        True, PACKED, per_document_prefix(PACKED, [[2, 6, 1], [7, 0]])
    ),  # a whole-prefix and a no-prefix doc
}


def qkv(
    q_len: int = T,
    k_len: int = T,
    seed: int = 0,
    dtype=torch.float32,
    *,
    heads: int = H,
    kv_heads: int = KV,
    dim: int = D,
    device: torch.device | str = "cpu",
    transposed: bool = False,
):
    """Random q, k, v (leaves that require grad), drawn in fp32 on the CPU, then moved to ``device`` and
    ``dtype``; ``transposed``: laid out as the model makes them (transposed views of [B, T, heads, D])."""
    gen = torch.Generator().manual_seed(seed)

    def draw(length: int, n_heads: int) -> torch.Tensor:
        if transposed:
            t = torch.randn(B, length, n_heads, dim, generator=gen).transpose(1, 2)
        else:
            t = torch.randn(B, n_heads, length, dim, generator=gen)
        return t.to(device, dtype).requires_grad_()

    return draw(q_len, heads), draw(k_len, kv_heads), draw(k_len, kv_heads)


def real_queries(mask: AttentionMask, q_len: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[B, 1, Tq, 1] on ``device``: queries whose outputs carry loss (not padding)."""
    if mask.q_segments is None:
        return torch.ones(B, 1, q_len, 1, dtype=torch.bool, device=device)
    return (mask.q_segments != PAD_SEGMENT).view(B, 1, q_len, 1).to(device)


def values_and_grads(core, q, k, v, mask, *extra, weight_seed: int = 7, all_queries: bool = False, **kwargs):
    """The core's outputs at real queries (``all_queries``: padding queries' too) and q/k/v gradients of a
    random weighting of them (``extra``, ``kwargs``: more arguments of the core, e.g. an ALiBi bias); on the
    core's device, with the same weighting on every device."""
    out = core(q, k, v, mask, 0.0, *extra, **kwargs)
    keep = True if all_queries else real_queries(mask, q.shape[2], out.device)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(weight_seed)).to(out.device)
    (out * weights * keep).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach() * keep, grads


def flat(result) -> tuple[torch.Tensor, ...]:
    """values_and_grads' result as (out, dq, dk, dv)."""
    return (result[0], *result[1])


def assert_same(flash, eager, atol=1e-5):
    assert torch.allclose(flash[0], eager[0], atol=atol), (flash[0] - eager[0]).abs().max()
    for got, want in zip(flash[1], eager[1]):
        assert torch.allclose(got, want, atol=atol), (got - want).abs().max()


def assert_close_in_bf16(kernel, eager, tolerance=2e-2):
    """A bf16 kernel's outputs and gradients against fp32 eager, by error relative to each tensor's norm (bf16
    keeps 8 bits: ~4e-3 per element, and gradients summed over many keys scale with them)."""
    for got, want in zip((kernel[0], *kernel[1]), (eager[0], *eager[1])):
        error = (got.float() - want).norm() / want.norm()
        assert error < tolerance, f"relative error {error:.3g}"


needs_flash = pytest.mark.skipif(
    not torch.cuda.is_available() or attention.flash_attn_module() is None,
    reason="needs CUDA and the flash-attn package (pip install flash-attn --no-build-isolation); CPU machines check "
    "flash_core against tests/support/flash_reference.py",
)


def document_positions(segments: torch.Tensor | None) -> torch.Tensor:
    """position_ids as the loader makes them: restarting at 0 for every run of equal segment ids."""
    if segments is None:
        return torch.arange(T).expand(B, -1)
    out = torch.zeros_like(segments)
    for b in range(segments.shape[0]):
        for t in range(1, segments.shape[1]):
            out[b, t] = out[b, t - 1] + 1 if segments[b, t] == segments[b, t - 1] else 0
    return out


def alibi_config(arch: str = "decoder", **fields) -> ModelConfig:
    """Six heads, not a power of two: the slopes' harder case."""
    return tiny_config(
        **{
            "arch": arch,
            "d_model": 48,
            "n_heads": 6,
            "d_ff": 64,
            "vocab_size": 64,
            "max_seq_len": 16,
            "position": "alibi",
            "attention_backend": "eager",
            **fields,
        }
    )


def packed_batch(arch: str) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 64, (B, T), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids, "segment_ids": PACKED, "position_ids": document_positions(PACKED)}
    if arch == "decoder":
        batch["prefix_len"] = per_document_prefix(PACKED, [[2, 6, 1], [7, 0]])
    elif arch == "encoder_decoder":
        dec = rows([4, 3, 6, -6], [2, 9, -8])
        batch.update(
            decoder_input_ids=ids.flip(1), decoder_segment_ids=dec, decoder_position_ids=document_positions(dec)
        )
    return batch
