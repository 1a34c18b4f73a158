"""The chunked attention core: exact (values and gradients) for every mask, GQA, caches; no L x L memory."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from support import attention as attention_support
from support.attention import flat
from support.models import tiny_config

from megatransformer.model import build_model
from megatransformer.model.attention import eager_core
from megatransformer.model.chunked_attention import chunked_core
from megatransformer.model.masks import AttentionMask, cross_attention_mask, self_attention_mask

PACKED = torch.tensor([[1] * 7 + [2] * 5 + [3] * 4 + [0] * 3, [1] * 10 + [2] * 9])
MASKS = {
    "causal": lambda: self_attention_mask(True),
    "bidirectional": lambda: self_attention_mask(False),
    "prefix": lambda: self_attention_mask(True, prefix_len=torch.tensor([3, 11])),
    "packed_causal": lambda: self_attention_mask(True, PACKED),
    "packed_bidirectional": lambda: self_attention_mask(False, PACKED),
    "packed_prefix": lambda: self_attention_mask(True, PACKED, torch.tensor([4, 2])),
    "per_document_prefixes": lambda: self_attention_mask(
        True, PACKED, torch.tensor([[3] * 7 + [10] * 5 + [13] * 4 + [0] * 3, [6] * 10 + [15] * 9])
    ),
}


def qkv(heads: int, kv_heads: int, q_len: int = 19, kv_len: int = 19, dim: int = 8, seed: int = 0):
    """Inputs laid out as the model makes them: transposed views of [B, T, heads, D] projections."""
    return attention_support.qkv(q_len, kv_len, seed, heads=heads, kv_heads=kv_heads, dim=dim, transposed=True)


def values_and_grads(core, q, k, v, mask: AttentionMask, **kwargs):
    """(out, dq, dk, dv) at every query, padding's too."""
    return flat(attention_support.values_and_grads(core, q, k, v, mask, weight_seed=5, all_queries=True, **kwargs))


@pytest.mark.parametrize("mask_name", list(MASKS))
@pytest.mark.parametrize("chunk", [4, 5, 64])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_values_and_gradients_match_eager_reference(mask_name, chunk, kv_heads):
    q, k, v = qkv(heads=4, kv_heads=kv_heads)
    mask = MASKS[mask_name]()
    expected = values_and_grads(eager_core, q, k, v, mask)
    got = values_and_grads(chunked_core, q, k, v, mask, chunk=chunk)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, expected):
        assert torch.allclose(a, b, atol=2e-6), (name, (a - b).abs().max())


def test_rendered_chunks_are_shared_by_layers_up_to_the_limit(monkeypatch):
    """Every layer gets the same chunk masks from one mask (rendered once); beyond the limit they are rendered
    per call and not kept."""
    mask = MASKS["packed_causal"]()
    q, k, v = qkv(4, 2)
    first = values_and_grads(chunked_core, q, k, v, mask, chunk=5)
    kept = dict(mask._rendered)
    assert len(kept) == 4  # (19 queries in chunks of 5)
    for (q_len, kv_len, start, end, k_start, _), blocked in kept.items():
        assert torch.equal(blocked, ~mask.dense(q_len, kv_len, torch.device("cpu"), start, end, k_start))
    second = values_and_grads(chunked_core, q, k, v, mask, chunk=5)  # another layer
    assert mask._rendered.keys() == kept.keys()
    assert all(mask._rendered[key] is blocked for key, blocked in kept.items())
    assert all(torch.equal(a, b) for a, b in zip(first, second))

    monkeypatch.setattr("megatransformer.model.masks.RENDERED_LIMIT", 2 * 19 * 10)  # two chunks' worth
    small = MASKS["packed_causal"]()
    values_and_grads(chunked_core, q, k, v, small, chunk=5)
    assert sum(t.numel() for t in small._rendered.values()) <= 2 * 19 * 10 and len(small._rendered) < 4


def test_cached_prefill_and_cross_attention_match_eager():
    q, k, v = qkv(heads=4, kv_heads=2, q_len=6, kv_len=15)
    cached = self_attention_mask(True, q_offset=9)  # 6 new queries after 9 cached positions
    dec, enc = torch.tensor([[1, 1, 2, 2, 2, 0]] * 2), torch.tensor([[1] * 8 + [2] * 7] * 2)
    for mask in (cached, cross_attention_mask(dec, enc)):
        expected = values_and_grads(eager_core, q, k, v, mask)
        got = values_and_grads(chunked_core, q, k, v, mask, chunk=4)
        for a, b in zip(got, expected):
            assert torch.allclose(a, b, atol=2e-6)


def test_bf16_error_is_that_of_a_bf16_implementation():
    """bf16 scores are rounded once more than in a fused kernel; the error must stay of bf16 size."""
    q, k, v = qkv(heads=4, kv_heads=2, q_len=64, kv_len=64, dim=16)
    mask = self_attention_mask(True)
    exact = values_and_grads(eager_core, *(t.double().detach().requires_grad_() for t in (q, k, v)), mask)
    low = [t.to(torch.bfloat16).detach().requires_grad_() for t in (q, k, v)]
    got = values_and_grads(chunked_core, *low, mask, chunk=16)
    for a, b in zip(got, exact):
        assert a.dtype == torch.bfloat16
        assert (a.double() - b).abs().max() < 0.05 * b.abs().max()


def test_autocast_runs_in_the_autocast_dtype_and_backpropagates():
    q, k, v = qkv(heads=4, kv_heads=2)
    with torch.autocast("cpu", torch.bfloat16):
        out = chunked_core(q, k, v, self_attention_mask(True), 0.0)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and torch.isfinite(q.grad).all()


def largest_allocation(length: int, mask_for) -> int:
    from torch.profiler import ProfilerActivity, profile

    q, k, v = qkv(heads=2, kv_heads=1, q_len=length, kv_len=length, dim=8)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        chunked_core(q, k, v, mask_for(length), 0.0, chunk=32).sum().backward()
    return max(e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")


@pytest.mark.parametrize("mask_name", ["causal", "packed", "prefix"])
def test_largest_allocation_grows_linearly_with_sequence_length(mask_name):
    """Doubling the sequence doubles the largest tensor of a training step (a chunk of scores); an L x L
    mask or score matrix would quadruple it."""
    mask_for = {
        "causal": lambda n: self_attention_mask(True),
        "packed": lambda n: self_attention_mask(True, PACKED.repeat(1, n // 19 + 1)[:, :n]),
        "prefix": lambda n: self_attention_mask(True, prefix_len=torch.tensor([n // 3, n // 2])),
    }[mask_name]
    small, large = largest_allocation(512, mask_for), largest_allocation(1024, mask_for)
    assert large <= 2.1 * small, (small, large)
    assert large < 2 * 1024 * 1024  # below one bool L x L mask per row of the batch


def test_model_trains_identically_with_chunked_and_sdpa():
    cfg = tiny_config()
    ids = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    segments = torch.tensor([[1] * 10 + [2] * 14] * 2)
    results = []
    for backend in ("sdpa", "chunked"):
        torch.manual_seed(0)
        model = build_model(cfg.model_copy(update={"attention_backend": backend})).train()
        loss = F.cross_entropy(model(ids, segment_ids=segments).flatten(0, 1), ids.flatten())
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.allclose(loss_a, loss_b, atol=1e-6)
    for a, b in zip(grads_a, grads_b):
        assert torch.allclose(a, b, atol=1e-6)


def test_attention_dropout_is_refused_with_the_fix():
    q, k, v = qkv(heads=4, kv_heads=2)
    with pytest.raises(ValueError, match="attention_dropout"):
        chunked_core(q, k, v, self_attention_mask(True), 0.1)


# ------------------------------------------------------------------ RMSNorm (the other memory/speed change)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2)])
def test_rmsnorm_matches_torch_values_and_gradients(dtype, tol):
    from megatransformer.model.layers import RMSNorm

    gen = torch.Generator().manual_seed(0)
    x0, grad = torch.randn(3, 7, 32, generator=gen) * 2, torch.randn(3, 7, 32, generator=gen).to(dtype)
    ref, ours = torch.nn.RMSNorm(32, eps=1e-5).to(dtype), RMSNorm(32, 1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5, generator=gen)
        ours.weight.copy_(ref.weight)
    xa, xb = (x0.to(dtype).clone().requires_grad_() for _ in range(2))
    ref(xa).backward(grad)
    out = ours(xb)
    out.backward(grad)
    assert out.dtype == dtype and xb.grad.dtype == dtype and ours.weight.grad.dtype == dtype
    assert torch.allclose(out, ref(xa), atol=tol)
    assert torch.allclose(xb.grad, xa.grad, atol=tol)
    assert torch.allclose(ours.weight.grad, ref.weight.grad, atol=tol * 10, rtol=tol)


def test_rmsnorm_keeps_only_its_input_for_backward():
    """nn.RMSNorm keeps two fp32 copies of a bf16 activation; ours keeps the bf16 input and 1/rms per row."""
    from megatransformer.model.layers import RMSNorm

    x = torch.randn(4, 16, 32, dtype=torch.bfloat16, requires_grad=True)
    norm = RMSNorm(32, 1e-5).to(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        norm(x)
    activation_bytes = sum(t.numel() * t.element_size() for t in saved if t.shape[:2] == x.shape[:2])
    assert activation_bytes <= x.numel() * x.element_size() + 4 * 16 * 4
