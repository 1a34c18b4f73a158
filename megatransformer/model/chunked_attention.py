"""Exact attention in query chunks with recomputation: the CPU training core (``attention_backend=chunked``).

``softmax(QK^T)V`` as a handful of large ``bmm`` calls per chunk of query rows, against only the keys each chunk
may see; the backward recomputes each chunk's probabilities, so activation memory is linear in sequence length
for every mask. Why and how (GQA without repeated keys, masks rendered once per batch, ALiBi per chunk):
docs/gpu.md, "On CPUs".
"""

from __future__ import annotations

import math
from contextvars import ContextVar

import torch

from megatransformer.model.masks import AttentionMask
from megatransformer.model.positions import Alibi

CHUNK = 64  # query positions per chunk (measured best of 32-256 at seq 512 and 2048, bf16 and fp32)
_IN_FORWARD = ContextVar("chunked_attention_forward", default=False)


def in_core_forward() -> bool:
    """Whether the chunked core's forward is running: its products are its own business (selective activation
    checkpointing keeps none of them; its backward recomputes each chunk)."""
    return _IN_FORWARD.get()


def _rows(x: torch.Tensor, start: int, end: int, scale: float | None = None) -> torch.Tensor:
    """Query-shaped [B, H, T, D] rows start:end as one contiguous [B * KV, C * G, D] matrix per key/value head.

    ``x`` is viewed as [B, KV, G, T, D]; rows are ordered (position, head of the group)."""
    batch, kv_heads, groups, _, dim = x.shape
    rows = x.new_empty(batch * kv_heads, (end - start) * groups, dim)  # always a copy: scaled in place
    rows.view(batch, kv_heads, end - start, groups, dim).copy_(x[:, :, :, start:end].transpose(2, 3))
    return rows.mul_(scale) if scale is not None else rows


def _scores(
    q_rows: torch.Tensor,
    keys: torch.Tensor,
    mask: AttentionMask,
    alibi: Alibi | None,
    q_len: int,
    batch: int,
    start: int,
    end: int,
    key_start: int,
) -> torch.Tensor:
    """Scores of one chunk against keys key_start:key_start + len(keys), [B * KV, C * G, K], ALiBi's bias
    added, disallowed entries at -inf."""
    scores = torch.bmm(q_rows, keys.transpose(1, 2))
    key_count, rows = keys.shape[1], end - start
    key_end = key_start + key_count
    view = scores.view(batch, -1, rows, scores.shape[1] // rows, key_count)  # [B, KV, C, G, K]
    if alibi is not None:
        bias = alibi.with_keys(alibi.k_positions[:, key_start:]).bias(start, end, key_count)  # [B, H, C, K]
        view += bias.view(batch, view.shape[1], -1, rows, key_count).transpose(2, 3).to(view.dtype)  # (KV, G)
    if mask.is_simple and mask.window is None:
        if mask.causal:  # only keys from the chunk's first query on can lie in the future of a row
            first = start + mask.q_offset
            future = torch.ones(rows, key_end - first, dtype=torch.bool, device=scores.device).triu(1)
            view[..., first:].masked_fill_(future.unsqueeze(1), float("-inf"))
    else:
        blocked = mask.blocked(q_len, key_end, scores.device, start, end, key_start)  # [B or 1, 1, C, K]
        view.masked_fill_(blocked.unsqueeze(3), float("-inf"))
    return scores


class ChunkedAttention(torch.autograd.Function):
    """q: [B, H, Tq, D]; k, v: [B, KV, Tk, D] -> [B, H, Tq, D] (a view of a [B, Tq, H, D] tensor)."""

    @staticmethod
    def forward(
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, alibi: Alibi | None, chunk: int
    ) -> torch.Tensor:
        if torch.compiler.is_compiling():  # (dynamo traces no context variable; compiled, the graph is what is kept)
            out = ChunkedAttention._forward(q, k, v, mask, alibi, chunk)
        else:
            inside = _IN_FORWARD.set(True)
            try:
                out = ChunkedAttention._forward(q, k, v, mask, alibi, chunk)
            finally:
                _IN_FORWARD.reset(inside)
        ctx.save_for_backward(q, k, v)
        ctx.mask, ctx.alibi, ctx.chunk = mask, alibi, chunk
        return out

    @staticmethod
    def _forward(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, alibi: Alibi | None, chunk: int
    ) -> torch.Tensor:
        batch, heads, q_len, dim = q.shape
        kv_heads, kv_len = k.shape[1], k.shape[2]
        groups, scale = heads // kv_heads, 1.0 / math.sqrt(dim)
        q5 = q.unflatten(1, (kv_heads, groups))
        keys, values = k.reshape(batch * kv_heads, kv_len, dim), v.reshape(batch * kv_heads, kv_len, dim)
        out = q.new_empty(batch, q_len, kv_heads, groups, dim)  # o_proj's layout: [B, T, H, D]
        for start in range(0, q_len, chunk):
            end = min(q_len, start + chunk)
            key_start, key_end = mask.key_start(start), mask.key_end(q_len, start, end, kv_len)
            scores = _scores(
                _rows(q5, start, end, scale),
                keys[:, key_start:key_end],
                mask,
                alibi,
                q_len,
                batch,
                start,
                end,
                key_start,
            )
            chunk_out = torch.bmm(torch.softmax(scores, dim=-1), values[:, key_start:key_end])
            out[:, start:end] = chunk_out.view(batch, kv_heads, end - start, groups, dim).transpose(1, 2)
        return out.view(batch, q_len, heads, dim).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v = ctx.saved_tensors
        mask, alibi, chunk = ctx.mask, ctx.alibi, ctx.chunk
        batch, heads, q_len, dim = q.shape
        kv_heads, kv_len = k.shape[1], k.shape[2]
        groups, scale = heads // kv_heads, 1.0 / math.sqrt(dim)
        q5, grad5 = q.unflatten(1, (kv_heads, groups)), grad_out.unflatten(1, (kv_heads, groups))
        keys, values = k.reshape(batch * kv_heads, kv_len, dim), v.reshape(batch * kv_heads, kv_len, dim)
        grad_q = q.new_empty(batch, q_len, kv_heads, groups, dim)  # q's usual layout: [B, T, H, D]
        grad_k = torch.zeros(keys.shape, dtype=torch.float32, device=k.device)  # sums over chunks: fp32
        grad_v = torch.zeros(values.shape, dtype=torch.float32, device=v.device)
        for start in range(0, q_len, chunk):
            end = min(q_len, start + chunk)
            key_start, key_end = mask.key_start(start), mask.key_end(q_len, start, end, kv_len)
            visible = slice(key_start, key_end)
            chunk_keys, chunk_values = keys[:, visible].contiguous(), values[:, visible].contiguous()
            q_rows, grad_rows = _rows(q5, start, end, scale), _rows(grad5, start, end)
            probs = torch.softmax(_scores(q_rows, chunk_keys, mask, alibi, q_len, batch, start, end, key_start), -1)
            grad_v[:, visible] += torch.bmm(probs.transpose(1, 2), grad_rows)
            grad_probs = torch.bmm(grad_rows, chunk_values.transpose(1, 2))
            grad_scores = torch._softmax_backward_data(grad_probs, probs, -1, probs.dtype)
            grad_k[:, visible] += torch.bmm(grad_scores.transpose(1, 2), q_rows)
            grad_rows = torch.bmm(grad_scores, chunk_keys).mul_(scale)
            grad_q[:, start:end] = grad_rows.view(batch, kv_heads, end - start, groups, dim).transpose(1, 2)
        grad_q = grad_q.view(batch, q_len, heads, dim).transpose(1, 2)
        grad_k = grad_k.view(k.shape).to(k.dtype)
        grad_v = grad_v.view(v.shape).to(v.dtype)
        return grad_q, grad_k, grad_v, None, None, None


def chunked_core(
    q, k, v, mask: AttentionMask, dropout: float, alibi: Alibi | None = None, chunk: int = CHUNK
) -> torch.Tensor:
    if dropout:
        raise ValueError("attention_backend=chunked does not support attention_dropout; set it to 0 or use sdpa")
    device = q.device.type
    if torch.is_autocast_enabled(device):  # run the matmuls in the autocast dtype, the Function without autocast
        dtype = torch.get_autocast_dtype(device)
        with torch.autocast(device, enabled=False):
            return ChunkedAttention.apply(q.to(dtype), k.to(dtype), v.to(dtype), mask, alibi, chunk)
    return ChunkedAttention.apply(q, k.to(q.dtype), v.to(q.dtype), mask, alibi, chunk)
