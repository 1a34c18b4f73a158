"""Attention inputs and masks for comparing an attention core with ``eager``: B rows of T positions, H query
heads over KV key/value heads of D dimensions; packed rows, padding and prefixes."""

from __future__ import annotations

import pytest
import torch

from megatransformer.batch import PAD_SEGMENT
from megatransformer.model import attention
from megatransformer.model.masks import AttentionMask, self_attention_mask

B, H, KV, T, D = 2, 4, 2, 19, 8


def rows(*segment_rows: list[int]) -> torch.Tensor:
    """Segment ids from run lengths per row: rows([3, 2], [5]) -> [[1,1,1,2,2], [1,1,1,1,1]] (0 pads)."""
    out = torch.zeros(len(segment_rows), T, dtype=torch.long)
    for r, lengths in enumerate(segment_rows):
        at = 0
        for index, n in enumerate(lengths):
            out[r, at:at + n] = index + 1 if n > 0 else 0
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
        True, PACKED, per_document_prefix(PACKED, [[2, 6, 1], [7, 0]])),  # a whole-prefix and a no-prefix doc
}


def qkv(q_len: int = T, k_len: int = T, seed: int = 0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, q_len, D, generator=gen, dtype=dtype).requires_grad_()
    k = torch.randn(B, KV, k_len, D, generator=gen, dtype=dtype).requires_grad_()
    v = torch.randn(B, KV, k_len, D, generator=gen, dtype=dtype).requires_grad_()
    return q, k, v


def real_queries(mask: AttentionMask, q_len: int) -> torch.Tensor:
    """[B, 1, Tq, 1]: queries whose outputs carry loss (not padding)."""
    if mask.q_segments is None:
        return torch.ones(B, 1, q_len, 1, dtype=torch.bool)
    return (mask.q_segments != PAD_SEGMENT).view(B, 1, q_len, 1)


def values_and_grads(core, q, k, v, mask, *extra, **kwargs):
    """The core's outputs at real queries and q/k/v gradients of a random weighting of them (``extra``,
    ``kwargs``: more arguments of the core, e.g. an ALiBi bias)."""
    out = core(q, k, v, mask, 0.0, *extra, **kwargs)
    keep = real_queries(mask, q.shape[2])
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(7))
    (out * weights * keep).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return out.detach() * keep, grads


def assert_same(flash, eager, atol=1e-5):
    assert torch.allclose(flash[0], eager[0], atol=atol), (flash[0] - eager[0]).abs().max()
    for got, want in zip(flash[1], eager[1]):
        assert torch.allclose(got, want, atol=atol), (got - want).abs().max()



def assert_bf16_close(flash, eager, keep: torch.Tensor) -> None:
    """A bf16 kernel's values_and_grads against eager's in fp32: outputs at the ``keep`` queries, gradients."""
    assert torch.allclose(flash[0].float() * keep, eager[0], atol=2e-2)
    for got, want in zip(flash[1], eager[1]):
        assert torch.allclose(got.float(), want, atol=5e-2)


needs_flash = pytest.mark.skipif(
    not torch.cuda.is_available() or attention.flash_attn_module() is None,
    reason="needs CUDA and the flash-attn package (pip install 'megatransformer[gpu]'); CPU machines check "
           "flash_core against tests/support/flash_reference.py",
)
