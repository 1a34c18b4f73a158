"""A slow, obvious implementation of flash-attn's documented contract, for tests on machines without CUDA.

``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
causal=...)``: q [total_q, H, D], k/v [total_k, H_kv, D] (H_kv divides H); sequence i is rows
cu_q[i]:cu_q[i+1] of q attending to rows cu_k[i]:cu_k[i+1] of k/v; ``causal`` is aligned to the bottom-right
corner (flash-attn >= 2.1): query j of a sequence sees keys up to j + (len_k - len_q). A query that sees no
key (an empty key sequence, or above the diagonal when len_q > len_k) gets zeros. ``flash_attn_func`` is the
same over equal-length rows ([B, T, H, D]). With ``max_seqlen_q == 1``, grouped-query heads, no ALiBi and no
dropout the kernel folds the query heads into the sequence axis (``flash_api.cpp``,
``seqlenq_ngroups_swapped``), which needs exactly one query in every sequence: asserted here.

``window_size=(left, right)`` (-1: unbounded): query j of a sequence sees only keys within
``[j + len_k - len_q - left, j + len_k - len_q + right]``, the same bottom-right alignment, on top of
``causal``.

``alibi_slopes`` (fp32 [H], or [n, H] with one row per sequence): flash-attn's docstring adds
``-alibi_slope * |i + seqlen_k - seqlen_q - j|`` to the score of query i and key j of a sequence. Its kernel
(``csrc/flash_attn/src/alibi.h`` and ``mask.h``) subtracts exactly that, absolute value included, when not
causal; when causal it adds ``alibi_slope * j``, which differs from the documented bias by a constant per
query row (on the allowed keys, j <= i + seqlen_k - seqlen_q) and so gives the same softmax. This reference
implements the documented bias for both.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    alibi_slopes=None,
    **unsupported,
):
    assert not unsupported and dropout_p == 0.0
    if alibi_slopes is not None:
        assert alibi_slopes.dtype == torch.float32 and alibi_slopes.shape[-1] == q.shape[1]
        assert alibi_slopes.dim() == 1 or alibi_slopes.shape[0] == len(cu_seqlens_q) - 1
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32 and len(cu_seqlens_q) == len(cu_seqlens_k)
    assert q.shape[1] % k.shape[1] == 0 and k.shape[0] == v.shape[0] == int(cu_seqlens_k[-1])
    assert q.shape[0] == int(cu_seqlens_q[-1])
    if max_seqlen_q == 1 and q.shape[1] > k.shape[1] and alibi_slopes is None and dropout_p == 0.0:
        # the kernel's "ngroups swapped" path reshapes q to [sequences, ...]: one query in every sequence
        assert q.shape[0] == len(cu_seqlens_q) - 1, "flash-attn's one-query GQA path needs a query per sequence"
    scale = softmax_scale or 1.0 / math.sqrt(q.shape[-1])
    groups = q.shape[1] // k.shape[1]
    pieces = []
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe, ks, ke = (int(x) for x in (cu_seqlens_q[i], cu_seqlens_q[i + 1], cu_seqlens_k[i], cu_seqlens_k[i + 1]))
        assert qe - qs <= max_seqlen_q and ke - ks <= max_seqlen_k
        if qe == qs:
            continue
        if ke == ks:
            pieces.append(q.new_zeros(qe - qs, *q.shape[1:]))
            continue
        qi = q[qs:qe].transpose(0, 1).float()  # [H, Lq, D]
        ki = k[ks:ke].repeat_interleave(groups, 1).transpose(0, 1).float()
        vi = v[ks:ke].repeat_interleave(groups, 1).transpose(0, 1).float()
        scores = qi @ ki.transpose(-1, -2) * scale
        rows = torch.arange(qe - qs, device=q.device).view(-1, 1)
        cols = torch.arange(ke - ks, device=q.device).view(1, -1)
        diagonal = rows + (ke - ks) - (qe - qs)  # bottom-right aligned: each query's own key
        if alibi_slopes is not None:
            slopes = alibi_slopes if alibi_slopes.dim() == 1 else alibi_slopes[i]
            scores = scores - slopes.view(-1, 1, 1) * (diagonal - cols).abs()
        allowed = torch.ones(qe - qs, ke - ks, dtype=torch.bool, device=q.device)
        if causal:
            allowed &= cols <= diagonal
        if window_size[0] >= 0:
            allowed &= cols >= diagonal - window_size[0]
        if window_size[1] >= 0:
            allowed &= cols <= diagonal + window_size[1]
        if not allowed.all():
            scores = scores.masked_fill(~allowed, float("-inf"))
            probs = torch.nan_to_num(scores.softmax(-1), nan=0.0) * allowed.any(-1, keepdim=True)
        else:
            probs = scores.softmax(-1)
        pieces.append((probs @ vi).transpose(0, 1).to(q.dtype))
    return torch.cat(pieces) if pieces else q.new_zeros(q.shape)


def flash_attn_func(
    q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None, **unsupported
):
    batch, q_len, heads, dim = q.shape
    k_len = k.shape[1]
    cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (batch + 1) * k_len, k_len, dtype=torch.int32, device=q.device)
    out = flash_attn_varlen_func(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        cu_q,
        cu_k,
        q_len,
        k_len,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        **unsupported,
    )
    return out.view(batch, q_len, heads, dim)


MODULE = SimpleNamespace(flash_attn_func=flash_attn_func, flash_attn_varlen_func=flash_attn_varlen_func)
