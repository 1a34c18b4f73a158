"""GPUs without the flash-attn package: ``auto`` takes PyTorch's own flash kernels, ``varlen_attn`` for packed
documents, prefix-LM and packed cross-attention, SDPA otherwise.

``varlen_attn`` needs CUDA, so on CPU the core runs on a recording stand-in that checks the documented
arguments and computes by ``tests/support/flash_reference.py`` (the same kernel contract: PyTorch's flash kernel
aligns causal attention to the bottom-right corner, as ``torch.nn.attention.bias.causal_lower_right`` relies
on); the ``gpu``-marked test runs the real kernel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.attention.varlen
from support import flash_reference
from support.attention import SELF_MASKS, assert_close_in_bf16, assert_same, qkv, rows, values_and_grads

from megatransformer.model import attention
from megatransformer.model.attention import eager_core
from megatransformer.model.masks import AttentionMask, cross_attention_mask, self_attention_mask
from megatransformer.model.positions import Alibi
from megatransformer.model.varlen import torch_varlen_available, torch_varlen_core

VARLEN_MASKS = {name: make for name, make in SELF_MASKS.items() if not make().is_simple}


def cross_mask() -> AttentionMask:
    return cross_attention_mask(rows([4, 3, 6, -6], [2, 9, 1, -7]), rows([6, 2, 4, -7], [10, 1, 8])[:, :15])


@pytest.fixture
def calls(monkeypatch):
    """``varlen_attn`` replaced by its documented contract; the list of its calls' arguments."""
    recorded = []

    def varlen_attn(
        query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False
    ):
        recorded.append(
            dict(
                cu_seq_q=cu_seq_q,
                cu_seq_k=cu_seq_k,
                max_q=max_q,
                max_k=max_k,
                scale=scale,
                window_size=window_size,
                enable_gqa=enable_gqa,
                heads=(query.shape[1], key.shape[1]),
            )
        )
        assert window_size[1] in (-1, 0, window_size[0])  # full, causal, or a window each side
        assert enable_gqa == (query.shape[1] != key.shape[1])
        assert type(max_q) is int and type(max_k) is int
        assert cu_seq_q.device == cu_seq_k.device == query.device
        return flash_reference.flash_attn_varlen_func(
            query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal=window_size[1] == 0, window_size=window_size
        )

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_attn)
    return recorded


@pytest.mark.parametrize("name", [*VARLEN_MASKS, "cross"])
def test_varlen_core_equals_eager_for_every_varlen_mask(calls, name):
    mask = cross_mask() if name == "cross" else VARLEN_MASKS[name]()
    q, k, v = qkv(k_len=15) if name == "cross" else qkv()
    assert_same(values_and_grads(torch_varlen_core, q, k, v, mask), values_and_grads(eager_core, q, k, v, mask))
    assert calls and all(c["enable_gqa"] and c["scale"] is None for c in calls)


@pytest.mark.parametrize("causal", [True, False])
def test_varlen_core_keeps_a_sliding_window(calls, causal):
    mask = self_attention_mask(causal, segment_ids=rows([5, 4, 7], [9, 7])).with_window(3)
    q, k, v = qkv()
    assert_same(values_and_grads(torch_varlen_core, q, k, v, mask), values_and_grads(eager_core, q, k, v, mask))
    assert {c["window_size"] for c in calls} == {(2, 0) if causal else (2, 2)}


def test_a_prefix_document_is_a_full_call_and_a_causal_call(calls):
    q, k, v = qkv()
    torch_varlen_core(q, k, v, SELF_MASKS["packed_prefix_per_document"](), 0.0)
    assert [c["window_size"] for c in calls] == [(-1, -1), (-1, 0)]
    assert all(c["cu_seq_q"].dtype == c["cu_seq_k"].dtype == torch.int32 for c in calls)


def test_pytorch_2_11s_kernel_without_gqa_gets_each_kv_head_repeated(calls, monkeypatch):
    contract = torch.nn.attention.varlen.varlen_attn

    def varlen_attn_2_11(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
        return contract(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale=scale, window_size=window_size)

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_attn_2_11)
    mask = SELF_MASKS["packed_prefix_per_document"]()
    q, k, v = qkv()
    assert_same(values_and_grads(torch_varlen_core, q, k, v, mask), values_and_grads(eager_core, q, k, v, mask))
    assert calls and all(c["heads"] == (q.shape[1], q.shape[1]) and not c["enable_gqa"] for c in calls)


def test_pytorch_2_10s_kernel_without_a_window_is_not_taken(monkeypatch):
    def varlen_attn_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, is_causal=False, return_aux=None):
        raise AssertionError("not called")

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", varlen_attn_2_10)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda: (9, 0))
    torch_varlen_available.cache_clear()
    try:
        assert not torch_varlen_available()
    finally:
        torch_varlen_available.cache_clear()


def test_varlen_core_refuses_dropout_and_alibi():
    q, k, v = qkv()
    mask = SELF_MASKS["packed_causal"]()
    with pytest.raises(ValueError, match="no attention dropout or ALiBi"):
        torch_varlen_core(q, k, v, mask, 0.1)
    alibi = Alibi(torch.ones(4), torch.zeros(2, 19), torch.zeros(2, 19))
    with pytest.raises(ValueError, match="no attention dropout or ALiBi"):
        torch_varlen_core(q, k, v, mask, 0.0, alibi)


def test_auto_takes_pytorchs_flash_kernels_without_flash_attn(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: False)
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: True)
    choose, bf16 = attention.auto_backend, torch.bfloat16
    packed, prefix = SELF_MASKS["packed_causal"](), SELF_MASKS["prefix_per_row"]()
    assert [choose("cuda", bf16, m) for m in (packed, prefix, cross_mask())] == ["varlen"] * 3
    assert [choose("cuda", bf16), choose("cuda", bf16, self_attention_mask(True))] == ["sdpa", "sdpa"]
    # what the kernel lacks or cannot run goes to SDPA
    assert [
        choose("cuda", bf16, packed, dropout=0.1),
        choose("cuda", bf16, packed, alibi=True),
        choose("cuda", torch.float32, packed),
        choose("cuda", bf16, packed, head_dim=512),
        choose("cuda", bf16, self_attention_mask(True, prefix_len=torch.tensor([2]), q_offset=4)),
    ] == ["sdpa"] * 5
    assert attention.describe_backend("auto", "cuda", bf16, 0.0) == (
        "attention: auto -> sdpa for causal/bidirectional, varlen for packed documents, prefix-LM, "
        "cross-attention on cuda in bfloat16 (flash-attn is not installed: pip install flash-attn "
        "--no-build-isolation)"
    )
    assert "auto -> sdpa for every mask" in attention.describe_backend("auto", "cuda", bf16, 0.0, alibi=True)
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: False)
    assert choose("cuda", bf16, packed) == "sdpa"
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: True)
    assert choose("cuda", bf16, packed) == "flash"


def test_auto_core_chooses_knowing_whether_alibi_is_on(monkeypatch):
    asked = []
    monkeypatch.setattr(attention, "auto_backend", lambda *args: asked.append(args) or "eager")
    q, k, v = qkv()
    mask = SELF_MASKS["packed_causal"]()
    attention.auto_core(q, k, v, mask, 0.0, Alibi(torch.ones(4), torch.zeros(2, 19), torch.zeros(2, 19)))
    attention.auto_core(q, k, v, mask, 0.0)
    assert [args[-1] for args in asked] == [True, False]


needs_varlen = pytest.mark.skipif(
    not torch.cuda.is_available() or not attention.torch_varlen_available(),
    reason="needs a CUDA GPU with PyTorch's flash kernel (compute capability 8.0+)",
)


@pytest.mark.gpu
@needs_varlen
@pytest.mark.parametrize("name", [*VARLEN_MASKS, "cross"])
def test_real_varlen_attn_equals_eager_for_every_varlen_mask(name):
    mask = (cross_mask() if name == "cross" else VARLEN_MASKS[name]()).to("cuda")
    q, k, v = (t.detach().cuda().bfloat16().requires_grad_() for t in (qkv(k_len=15) if name == "cross" else qkv()))
    got = values_and_grads(torch_varlen_core, q, k, v, mask)
    want = values_and_grads(eager_core, *(t.detach().float().requires_grad_() for t in (q, k, v)), mask)
    assert_close_in_bf16(got, want)
