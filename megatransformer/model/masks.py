"""Attention masks as a description, rendered per backend.

An :class:`AttentionMask` says *which* keys a query may see (causal order, a bidirectional prefix, document
segments); each backend turns it into what it needs: nothing at all for plain causal/bidirectional SDPA,
a dense boolean mask, a FlexAttention block mask, or flash-attn's ``cu_seqlens``. The rule, for query
position ``q`` and key position ``k`` of row ``b``::

    order_ok   = not causal or k <= q or k < prefix_len[b]        (prefix_len [B]: one prefix per row)
                                    or k < prefix_len[b, q]     (prefix_len [B, Tq]: per query)
    segment_ok = q_seg[b, q] == k_seg[b, k] or q_seg[b, q] == PAD_SEGMENT
    allowed    = order_ok and segment_ok

Per-query prefix ends let packed rows hold several prefix-LM documents: ``prefix_len[b, q]`` is where the
prefix of q's document ends (an index into the row), and the segment check keeps the documents apart.

Padding queries may attend anywhere, so no row is ever fully masked (which would produce NaN); their
outputs carry no loss. Real queries never see padding keys or other documents.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatransformer.batch import PAD_SEGMENT


@dataclass(frozen=True)
class AttentionMask:
    causal: bool
    q_segments: torch.Tensor | None = None  # [B, Tq]
    kv_segments: torch.Tensor | None = None  # [B, Tk]
    prefix_len: torch.Tensor | None = None  # [B] or [B, Tq], see the module docstring
    q_offset: int = 0  # absolute position of the first query (decoding with a KV cache)

    @property
    def is_simple(self) -> bool:
        """Plain causal or full attention: backends need no explicit mask."""
        return self.q_segments is None and self.prefix_len is None

    def dense(self, q_len: int, kv_len: int, device: torch.device, q_start: int = 0,
              q_end: int | None = None) -> torch.Tensor:
        """Boolean mask [B or 1, 1, Tq, Tk], True where attention is allowed.

        ``q_start:q_end`` renders only those query rows (of ``q_len``) and ``kv_len`` only the first keys:
        the chunked backend builds one chunk's rows at a time, never the whole L x L mask.
        """
        q_end = q_len if q_end is None else q_end
        rows = q_end - q_start
        q = torch.arange(q_start, q_end, device=device).view(1, rows, 1) + self.q_offset
        k = torch.arange(kv_len, device=device).view(1, 1, kv_len)
        allowed = torch.ones(1, rows, kv_len, dtype=torch.bool, device=device)
        if self.causal:
            order = k <= q
            if self.prefix_len is not None:
                order = order | (k < self.prefix_ends(q_len, q_start, q_end).unsqueeze(-1))
            allowed = allowed & order
        if self.q_segments is not None:
            q_seg = self.q_segments[:, -q_len:][:, q_start:q_end].unsqueeze(2)
            k_seg = self.kv_segments[:, :kv_len].unsqueeze(1)
            allowed = allowed & ((q_seg == k_seg) | (q_seg == PAD_SEGMENT))
        return allowed.unsqueeze(1)

    def prefix_ends(self, q_len: int, q_start: int = 0, q_end: int | None = None) -> torch.Tensor:
        """Where the bidirectional prefix ends for query rows q_start:q_end: [B, rows] or [B, 1]."""
        if self.prefix_len.dim() == 1:
            return self.prefix_len.view(-1, 1)
        return self.prefix_len[:, -q_len:][:, q_start:q_end]

    def mask_mod(self):
        """The same rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``."""
        causal, offset = self.causal, self.q_offset
        q_segments, kv_segments, prefix_len = self.q_segments, self.kv_segments, self.prefix_len

        def mod(b, h, q_idx, kv_idx):
            q_pos = q_idx + offset
            allowed = (kv_idx <= q_pos) if causal else (kv_idx >= 0)
            if causal and prefix_len is not None:
                allowed = allowed | (kv_idx < (prefix_len[b] if prefix_len.dim() == 1 else prefix_len[b, q_idx]))
            if q_segments is not None:
                q_seg = q_segments[b, q_idx]
                allowed = allowed & ((q_seg == kv_segments[b, kv_idx]) | (q_seg == PAD_SEGMENT))
            return allowed

        return mod


def self_attention_mask(
    causal: bool,
    segment_ids: torch.Tensor | None = None,
    prefix_len: torch.Tensor | None = None,
    q_offset: int = 0,
) -> AttentionMask:
    """Mask for self-attention; drops the segment check when every token is one document."""
    if segment_ids is not None and bool((segment_ids == segment_ids[:, :1]).all()):
        segment_ids = None
    if not causal and prefix_len is not None:
        raise ValueError("prefix_len only makes sense for causal self-attention")
    return AttentionMask(causal, segment_ids, segment_ids, prefix_len, q_offset)


def cross_attention_mask(
    q_segments: torch.Tensor | None, kv_segments: torch.Tensor | None
) -> AttentionMask:
    """Decoder queries see the encoder tokens of their own example (segment)."""
    if q_segments is None or kv_segments is None:
        return AttentionMask(causal=False)
    return AttentionMask(False, q_segments, kv_segments)


def cu_seqlens(segment_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """flash-attn varlen boundaries: every run of equal segment ids in a row is one sequence.

    Returns int32 cumulative lengths over the flattened batch and the longest run.
    """
    batch, length = segment_ids.shape
    starts = torch.ones_like(segment_ids, dtype=torch.bool)
    starts[:, 1:] = segment_ids[:, 1:] != segment_ids[:, :-1]
    start_idx = torch.nonzero(starts.flatten(), as_tuple=False).flatten()
    bounds = torch.cat([start_idx, start_idx.new_tensor([batch * length])]).to(torch.int32)
    return bounds, int((bounds[1:] - bounds[:-1]).max())
