"""Documents that continue a shared context (masks.shared_context_mask): every core gives each continuation the
attention it has as a document of its own after a copy of the context, and flash-attn's varlen problem says so
(on CPU through tests/support/flash_reference.py; the ``gpu``-marked test runs the real kernels)."""

from __future__ import annotations

import pytest
import torch
from support.attention import B, T, assert_close_in_bf16, needs_flash, qkv, values_and_grads

from megatransformer.model.attention import eager_core, flash_core, sdpa_core
from megatransformer.model.chunked_attention import chunked_core
from megatransformer.model.masks import self_attention_mask, shared_context_mask

# row 0: a context of 5 (segment 1), continuations of 3, 1 and 2 (segments 2-4), a document alone (5), padding;
# row 1: a context of 4 with continuations of 6 and 2, then a context of 3 with one of 4
SEGMENTS = torch.tensor(
    [[1] * 5 + [2] * 3 + [3] + [4] * 2 + [5] * 5 + [0] * 3, [1] * 4 + [2] * 6 + [3] * 2 + [4] * 3 + [5] * 4]
)
CONTEXTS = torch.tensor(
    [[1] * 5 + [1] * 3 + [1] + [1] * 2 + [5] * 5 + [0] * 3, [1] * 4 + [1] * 6 + [1] * 2 + [4] * 3 + [4] * 4]
)


def apart(segments: torch.Tensor, contexts: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """Each document after its own copy of its context: per row, the shared row's places in that order, and the
    segments of that layout (one per copy)."""
    places, out = [], []
    for seg_row, ctx_row in zip(segments.tolist(), contexts.tolist()):
        row, row_segments = [], []
        for document, segment in enumerate(dict.fromkeys(s for s in seg_row if s), 1):
            own = [i for i, s in enumerate(seg_row) if s == segment]
            context = ctx_row[own[0]]
            copied = [i for i, s in enumerate(seg_row) if s == context] if context != segment else []
            row += copied + own
            row_segments += [document] * (len(copied) + len(own))
        places.append(row)
        out.append(row_segments)
    width = max(map(len, places))
    return places, torch.tensor([r + [0] * (width - len(r)) for r in out])


def gather(x: torch.Tensor, places: list[list[int]], width: int) -> torch.Tensor:
    """[B, H, T, D] rows rearranged to ``places`` (zeros after them)."""
    out = x.new_zeros(x.shape[0], x.shape[1], width, x.shape[3])
    for b, row in enumerate(places):
        out[b, :, : len(row)] = x[b, :, row]
    return out


def chunked_by_4(q, k, v, mask, dropout):
    return chunked_core(q, k, v, mask, dropout, chunk=4)


@pytest.mark.parametrize(
    "core", [eager_core, sdpa_core, chunked_core, chunked_by_4, flash_core], ids=lambda c: c.__name__
)
def test_each_continuation_sees_its_context_and_itself(reference_flash, core):
    mask = shared_context_mask(SEGMENTS, CONTEXTS, varlen=core is flash_core)
    q, k, v = (t.detach() for t in qkv())
    shared = core(q, k, v, mask, 0.0)
    places, segments = apart(SEGMENTS, CONTEXTS)
    width = segments.shape[1]
    alone = eager_core(*(gather(t, places, width) for t in (q, k, v)), self_attention_mask(True, segments), 0.0)
    checked = 0
    for b, row in enumerate(places):
        for at, place in enumerate(row):
            # a place's own output: where it appears as itself (the last time: copies of a context come first)
            if at == max(i for i, p in enumerate(row) if p == place):
                assert torch.allclose(shared[b, :, place], alone[b, :, at], atol=1e-6), (b, place)
                checked += 1
    assert checked == int((SEGMENTS != 0).sum())


def test_padding_and_plain_rows_keep_the_packed_mask():
    mask = shared_context_mask(SEGMENTS, SEGMENTS, varlen=True)  # every document on its own
    assert mask.contexts is None and torch.equal(mask.q_segments, SEGMENTS)
    one = shared_context_mask(torch.ones(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long))
    assert one.is_simple


def test_varlen_problem_gathers_the_context_before_each_continuation():
    segments = torch.tensor([[1, 1, 2, 2, 3, 0]])
    contexts = torch.tensor([[1, 1, 1, 1, 1, 0]])
    (problem,) = shared_context_mask(segments, contexts, varlen=True).varlen
    assert problem.causal and problem.q_index is None  # every query, in order
    assert problem.cu_q.tolist() == [0, 2, 4, 5, 6] and problem.cu_k.tolist() == [0, 2, 6, 9, 10]
    assert problem.k_index.tolist() == [0, 1, 0, 1, 2, 3, 0, 1, 4, 5]
    assert (problem.max_q, problem.max_k) == (2, 4)


def test_a_context_outside_the_row_is_refused():
    with pytest.raises(ValueError, match="not in its row"):
        shared_context_mask(torch.tensor([[1, 1, 2, 2]]), torch.tensor([[1, 1, 7, 7]]), varlen=True)


def test_shared_contexts_take_no_window():
    with pytest.raises(ValueError, match="does not combine with shared contexts"):
        shared_context_mask(SEGMENTS, CONTEXTS).with_window(4)


@pytest.mark.gpu
@needs_flash
def test_real_flash_attn_equals_eager_for_shared_contexts():
    from megatransformer.model.varlen import torch_varlen_available, torch_varlen_core

    mask = shared_context_mask(SEGMENTS, CONTEXTS, varlen=True).to("cuda")
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_() for t in qkv())
    eager = values_and_grads(eager_core, *(t.detach().float().requires_grad_() for t in (q, k, v)), mask)
    assert_close_in_bf16(values_and_grads(flash_core, q, k, v, mask), eager)
    if torch_varlen_available():
        assert_close_in_bf16(values_and_grads(torch_varlen_core, q, k, v, mask), eager)
