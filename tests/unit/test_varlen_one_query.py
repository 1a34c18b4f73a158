"""flash-attn varlen problems hold no sequence without queries.

flash-attn runs a problem whose longest query sequence is 1 (grouped-query heads, no ALiBi, no dropout) on a
kernel that assumes exactly one query per sequence; ``tests/support/flash_reference.py`` asserts that assumption,
so these masks, whose problems have one-query sequences beside all-prefix documents or key-only segments,
are checked against ``eager`` on CPU.
"""

from __future__ import annotations

import pytest
import torch

from megatransformer.model import attention
from megatransformer.model.attention import eager_core, flash_core
from megatransformer.model.masks import cross_attention_mask, self_attention_mask

B, H, KV, D = 2, 4, 2, 8
SEGMENTS = torch.tensor([[1, 1, 1, 2, 2, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1, 1]])
PREFIX_ENDS = torch.tensor([[2, 2, 2, 6, 6, 6, 7, 7], [7] * 8])  # doc 2 of row 0 is all prefix; others: 1 query

MASKS = {
    "prefix_per_row": (lambda: self_attention_mask(True, prefix_len=torch.tensor([8, 7])), 8, 8),
    "prefix_per_document": (lambda: self_attention_mask(True, SEGMENTS, PREFIX_ENDS), 8, 8),
    "cross_one_query": (
        lambda: cross_attention_mask(torch.ones(B, 1, dtype=torch.long), torch.tensor([[1, 1, 2, 2, 2, 0], [1] * 6])),
        1,
        6,
    ),
    "cross_key_only_segments": (
        lambda: cross_attention_mask(
            torch.tensor([[1, 1, 2, 2], [1, 1, 1, 1]]), torch.tensor([[1, 1, 2, 3, 3, 0], [2, 1, 1, 1, 0, 0]])
        ),
        4,
        6,
    ),
}


def output_and_grads(core, mask, q_len: int, k_len: int, device: str = "cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, q_len, D, generator=gen).to(device, dtype).requires_grad_()
    k, v = (torch.randn(B, KV, k_len, D, generator=gen).to(device, dtype).requires_grad_() for _ in range(2))
    out = core(q, k, v, mask.to(device), 0.0)
    (out * torch.randn(out.shape, generator=gen).to(device, dtype)).sum().backward()
    return [t.float().cpu() for t in (out.detach(), q.grad, k.grad, v.grad)]


@pytest.mark.parametrize("name", MASKS)
def test_varlen_problems_hold_a_query_in_every_sequence(name):
    build, q_len, k_len = MASKS[name]
    for problem in build().varlen_problems(B, q_len, k_len):
        assert (problem.cu_q.diff() > 0).all()
        assert int(problem.cu_k[-1]) == (B * k_len if problem.k_index is None else len(problem.k_index))


@pytest.mark.parametrize("name", MASKS)
def test_one_query_problems_equal_eager(reference_flash, name):
    build, q_len, k_len = MASKS[name]
    flash = output_and_grads(flash_core, build(), q_len, k_len)
    eager = output_and_grads(eager_core, build(), q_len, k_len)
    for got, want in zip(flash, eager, strict=True):
        assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or attention.flash_attn_module() is None,
    reason="needs CUDA and the flash-attn package (pip install flash-attn --no-build-isolation)",
)
@pytest.mark.parametrize("name", MASKS)
def test_real_flash_attn_one_query_problems_equal_eager(name):
    build, q_len, k_len = MASKS[name]
    flash = output_and_grads(flash_core, build(), q_len, k_len, "cuda", torch.bfloat16)
    eager = output_and_grads(eager_core, build(), q_len, k_len, "cuda", torch.float32)
    for got, want in zip(flash, eager, strict=True):
        assert torch.allclose(got, want, atol=5e-2, rtol=2e-2), (got - want).abs().max()
