"""Attention masks as a description, rendered per backend, with their metadata built once per batch.

An :class:`AttentionMask` says *which* keys a query may see (causal order, a bidirectional prefix per row or per
query, document segments, documents that continue a shared context, a sliding window); each core renders what it
needs: nothing, a dense boolean mask, a FlexAttention block mask or flash-attn varlen problems. Host metadata
(``cu_seqlens``, key bounds) is computed once per batch by :func:`batch_masks`, so a step never waits for the device
to learn a shape. The rule and the design: docs/gpu.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from megatransformer.batch import PAD_SEGMENT

RENDERED_LIMIT = 2**26  # booleans (64 MiB) of rendered chunk masks one AttentionMask keeps for its layers


@dataclass(frozen=True)
class VarlenProblem:
    """One call of flash-attn's ``flash_attn_varlen_func`` over the flattened batch.

    Queries ``q_index`` of the flattened ``[B * Tq]`` rows (all, in order, when None) form sequences with
    cumulative lengths ``cu_q``; keys ``k_index`` of ``[B * Tk]`` form ``cu_k``. Sequence i of the queries
    attends to sequence i of the keys, causally bottom-right aligned (flash-attn >= 2.1) when ``causal``.
    """

    cu_q: torch.Tensor  # int32 [n + 1]
    cu_k: torch.Tensor  # int32 [n + 1]
    max_q: int
    max_k: int
    causal: bool
    q_index: torch.Tensor | None = None  # int64 [total_q]
    k_index: torch.Tensor | None = None  # int64 [total_k]

    def to(self, device: torch.device | str) -> VarlenProblem:
        def move(t):
            return to_device(t, device)

        return replace(
            self, cu_q=move(self.cu_q), cu_k=move(self.cu_k), q_index=move(self.q_index), k_index=move(self.k_index)
        )


@dataclass(frozen=True, eq=False)
class AttentionMask:
    causal: bool
    q_segments: torch.Tensor | None = None  # [B, Tq]
    kv_segments: torch.Tensor | None = None  # [B, Tk]
    prefix_len: torch.Tensor | None = None  # [B] or [B, Tq], see the module docstring
    q_offset: int = 0  # absolute position of the first query (decoding with a KV cache)
    window: int | None = None  # local attention: keys less than `window` positions away, see the module docstring
    contexts: torch.Tensor | None = None
    """[B, T] with ``q_segments`` (causal self-attention): per position, the segment whose keys it sees besides
    its own segment's: the shared context a document continues (the choices of a multiple-choice item packed
    after one copy of their question); a position that continues no other segment names its own."""
    varlen: tuple[VarlenProblem, ...] | None = None
    """flash-attn's problems for this mask, built on the host by :func:`batch_masks` (else on first use)."""
    key_bounds: np.ndarray | None = None
    """Host array [Tq] (or [1]): for causal masks with a prefix, where the prefix of any row ends at that query
    position, so the chunked core skips the keys past it without asking the device."""
    _rendered: dict[tuple, torch.Tensor] = field(default_factory=dict, init=False, repr=False, compare=False)
    """The chunks :meth:`blocked` rendered so far (a plain dict: ``torch.compile`` traces it without a break)."""

    @property
    def is_simple(self) -> bool:
        """Plain causal or full attention: backends need no explicit mask."""
        return self.q_segments is None and self.prefix_len is None

    def with_window(self, window: int | None) -> AttentionMask:
        """This mask restricted to a sliding window (a new mask: chunks rendered without it are not reused)."""
        if window is None:
            return self
        if self.prefix_len is not None:
            raise ValueError("model.attention_window does not combine with a bidirectional prefix (prefix-LM)")
        if self.contexts is not None:
            raise ValueError("model.attention_window does not combine with shared contexts")
        return replace(self, window=window)

    def to(self, device: torch.device | str, moved: Mapping[int, torch.Tensor] | None = None) -> AttentionMask:
        """The mask with its tensors on ``device`` (``key_bounds`` stays on the host, where it is read);
        ``moved``: tensors already copied there, by the id of their host tensor (not copied again)."""

        def move(t):
            return to_device(t, device, moved)

        q_segments = move(self.q_segments)
        kv_segments = q_segments if self.kv_segments is self.q_segments else move(self.kv_segments)
        varlen = None if self.varlen is None else tuple(p.to(device) for p in self.varlen)
        return replace(
            self,
            q_segments=q_segments,
            kv_segments=kv_segments,
            prefix_len=move(self.prefix_len),
            contexts=move(self.contexts),
            varlen=varlen,
        )

    def dense(
        self,
        q_len: int,
        kv_len: int,
        device: torch.device,
        q_start: int = 0,
        q_end: int | None = None,
        k_start: int = 0,
    ) -> torch.Tensor:
        """Boolean mask [B or 1, 1, Tq, Tk], True where attention is allowed.

        ``q_start:q_end`` renders only those query rows (of ``q_len``) and ``k_start:kv_len`` only those keys:
        the chunked backend builds one chunk's rows at a time, never the whole L x L mask.
        """
        q_end = q_len if q_end is None else q_end
        rows, keys = q_end - q_start, kv_len - k_start
        q = torch.arange(q_start, q_end, device=device).view(1, rows, 1) + self.q_offset
        k = torch.arange(k_start, kv_len, device=device).view(1, 1, keys)
        allowed = torch.ones(1, rows, keys, dtype=torch.bool, device=device)
        if self.window is not None:
            allowed = allowed & ((q - k).abs() < self.window)
        if self.causal:
            order = k <= q
            if self.prefix_len is not None:
                order = order | (k < self.prefix_ends(q_len, q_start, q_end).unsqueeze(-1))
            allowed = allowed & order
        if self.q_segments is not None:
            q_seg = self.q_segments[:, -q_len:][:, q_start:q_end].unsqueeze(2)
            k_seg = self.kv_segments[:, k_start:kv_len].unsqueeze(1)
            seen = q_seg == k_seg
            if self.contexts is not None:
                seen = seen | (self.contexts[:, -q_len:][:, q_start:q_end].unsqueeze(2) == k_seg)
            allowed = allowed & (seen | (q_seg == PAD_SEGMENT))
        return allowed.unsqueeze(1)

    def blocked(
        self, q_len: int, kv_len: int, device: torch.device, q_start: int, q_end: int, k_start: int = 0
    ) -> torch.Tensor:
        """``~dense(...)`` of query rows q_start:q_end and keys k_start:kv_len: True where attention is not
        allowed. Rendered once per mask and kept (up to RENDERED_LIMIT elements in all): the mask is built once
        per batch and handed to every layer, whose chunked core asks for the same chunks in forward and
        backward (16 renders of each with 8 layers). Not kept under ``torch.compile``, whose graph renders it
        anyway: the cache's contents would be guarded, a graph for an empty cache and another for a filled one."""
        if torch.compiler.is_compiling():
            return ~self.dense(q_len, kv_len, device, q_start, q_end, k_start)
        key = (q_len, kv_len, q_start, q_end, k_start, str(device))
        rendered = self._rendered
        if key in rendered:
            return rendered[key]
        blocked = ~self.dense(q_len, kv_len, device, q_start, q_end, k_start)
        if sum(t.numel() for t in rendered.values()) + blocked.numel() <= RENDERED_LIMIT:
            rendered[key] = blocked
        return blocked

    def prefix_ends(self, q_len: int, q_start: int = 0, q_end: int | None = None) -> torch.Tensor:
        """Where the bidirectional prefix ends for query rows q_start:q_end: [B, rows] or [B, 1]."""
        if self.prefix_len.dim() == 1:
            return self.prefix_len.view(-1, 1)
        return self.prefix_len[:, -q_len:][:, q_start:q_end]

    def key_start(self, q_start: int) -> int:
        """Queries from q_start on see no key before this one (0 without a window)."""
        return 0 if self.window is None else max(0, self.q_offset + q_start - self.window + 1)

    def key_end(self, q_len: int, q_start: int, q_end: int, kv_len: int) -> int:
        """Keys 0..end are all that queries q_start:q_end of a causal or windowed mask may see (else all keys).

        Under ``torch.compile`` a prefix's bound, a value of the batch, would be a new shape (a recompilation)
        per batch: a compiled chunk of a prefix mask takes every key (the mask still blocks those it may not see).
        """
        if not self.causal:
            return kv_len if self.window is None else min(kv_len, self.q_offset + q_end - 1 + self.window)
        end = self.q_offset + q_end
        if self.prefix_len is not None:
            if torch.compiler.is_compiling():
                return kv_len
            bounds = self._host_key_bounds()  # [Tq], or [1] for one prefix per row
            end = max(end, int((bounds if len(bounds) == 1 else bounds[-q_len:][q_start:q_end]).max()))
        return min(end, kv_len)

    def _host_key_bounds(self) -> np.ndarray:
        """``key_bounds``, computed from the prefix the first time when the mask was built without them
        (reading it from the device once per mask)."""
        if self.key_bounds is None:
            object.__setattr__(self, "key_bounds", _key_bounds(self.prefix_len))
        return self.key_bounds

    def varlen_problems(self, batch: int, q_len: int, kv_len: int) -> tuple[VarlenProblem, ...]:
        """flash-attn's problems: those built with the batch, else computed now (reads the masks' values)."""
        if self.varlen is not None:
            return self.varlen
        if self.q_offset:
            raise ValueError("flash-attn varlen attention takes no KV-cache offset with a non-causal mask")
        device = (self.q_segments if self.q_segments is not None else self.prefix_len).device
        if self.kv_segments is not self.q_segments:
            problems = (cross_varlen_problem(_numpy(self.q_segments), _numpy(self.kv_segments)),)
        elif self.contexts is not None:
            problems = (context_varlen_problem(_numpy(self.q_segments), _numpy(self.contexts)),)
        else:
            problems = varlen_problems(self.causal, _numpy(self.q_segments), _numpy(self.prefix_len), (batch, q_len))
        return tuple(p.to(device) for p in problems)

    def mask_mod(self):
        """The same rule as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx)``."""
        causal, offset, window = self.causal, self.q_offset, self.window
        q_segments, kv_segments, prefix_len = self.q_segments, self.kv_segments, self.prefix_len
        contexts = self.contexts

        def mod(b, h, q_idx, kv_idx):
            q_pos = q_idx + offset
            allowed = (kv_idx <= q_pos) if causal else (kv_idx >= 0)
            if window is not None:
                allowed = allowed & ((q_pos - kv_idx).abs() < window)
            if causal and prefix_len is not None:
                allowed = allowed | (kv_idx < (prefix_len[b] if prefix_len.dim() == 1 else prefix_len[b, q_idx]))
            if q_segments is not None:
                q_seg, k_seg = q_segments[b, q_idx], kv_segments[b, kv_idx]
                seen = q_seg == k_seg
                if contexts is not None:
                    seen = seen | (contexts[b, q_idx] == k_seg)
                allowed = allowed & (seen | (q_seg == PAD_SEGMENT))
            return allowed

        return mod


def self_attention_mask(
    causal: bool,
    segment_ids: torch.Tensor | None = None,
    prefix_len: torch.Tensor | None = None,
    q_offset: int = 0,
) -> AttentionMask:
    """Mask for self-attention; drops the segment check when every row is one document.

    That check reads the segment values: built here from device tensors it waits for the device once per
    forward. Training builds its masks on the host with :func:`batch_masks` instead.
    """
    if segment_ids is not None and bool((segment_ids == segment_ids[:, :1]).all()):
        segment_ids = None
    if not causal and prefix_len is not None:
        raise ValueError("prefix_len only makes sense for causal self-attention")
    return AttentionMask(causal, segment_ids, segment_ids, prefix_len, q_offset)


def cross_attention_mask(q_segments: torch.Tensor | None, kv_segments: torch.Tensor | None) -> AttentionMask:
    """Decoder queries see the encoder tokens of their own example (segment)."""
    if q_segments is None or kv_segments is None:
        return AttentionMask(causal=False)
    return AttentionMask(False, q_segments, kv_segments)


# -------------------------------------------------------------------------------- per-batch metadata


@dataclass(frozen=True)
class ModelMasks:
    """Every mask one forward of a model needs, built once per batch and handed to every layer."""

    encoder: AttentionMask | None = None  # encoder-only model, or the encoder of an encoder-decoder
    decoder: AttentionMask | None = None  # decoder-only model, or the decoder's self-attention
    cross: AttentionMask | None = None  # encoder-decoder: decoder queries to encoder keys

    def to(self, device: torch.device | str, moved: Mapping[int, torch.Tensor] | None = None) -> ModelMasks:
        """On ``device``; ``moved`` as in :meth:`AttentionMask.to` (the batch's segment tensors, copied once)."""
        return ModelMasks(
            *(None if m is None else m.to(device, moved) for m in (self.encoder, self.decoder, self.cross))
        )


def batch_masks(arch: str, batch: Mapping[str, torch.Tensor], varlen: bool = False) -> ModelMasks:
    """The masks of a model ``arch`` for a batch still on the host (CPU tensors, as the loader made them).

    Everything that depends on the values of segments and prefixes is decided here, in NumPy: whether a row
    holds one document, the chunked core's key bounds and, with ``varlen`` (a run that may use flash-attn),
    flash-attn's varlen problems. Move the result with :meth:`ModelMasks.to`.
    """
    segments = batch.get("segment_ids")
    shape = tuple(batch["input_ids"].shape)
    if arch == "encoder":
        return ModelMasks(encoder=_host_self_mask(False, segments, None, shape, varlen))
    if arch == "decoder":
        return ModelMasks(decoder=_host_self_mask(True, segments, batch.get("prefix_len"), shape, varlen))
    decoder_segments = batch.get("decoder_segment_ids")
    cross = cross_attention_mask(decoder_segments, segments)
    if varlen and not cross.is_simple:
        cross = replace(cross, varlen=(cross_varlen_problem(_numpy(decoder_segments), _numpy(segments)),))
    return ModelMasks(
        encoder=_host_self_mask(False, segments, None, shape, varlen),
        decoder=_host_self_mask(True, decoder_segments, None, tuple(batch["decoder_input_ids"].shape), varlen),
        cross=cross,
    )


def shared_context_mask(segments: torch.Tensor, contexts: torch.Tensor, varlen: bool = False) -> AttentionMask:
    """Causal self-attention of packed documents on the host (CPU tensors), where a document may continue the
    context of another segment of its row: ``contexts`` as :attr:`AttentionMask.contexts`. Each continuation
    comes after its context in its row (causal order is the row's) and its ``position_ids`` go on from the
    context's end; the context is run once for all of them. ``varlen``: with flash-attn's problems."""
    return _host_self_mask(True, segments, None, tuple(segments.shape), varlen, contexts)


def _host_self_mask(
    causal: bool,
    segments: torch.Tensor | None,
    prefix_len: torch.Tensor | None,
    shape: tuple[int, int],
    varlen: bool,
    contexts: torch.Tensor | None = None,
) -> AttentionMask:
    host_segments, host_contexts = _numpy(segments), _numpy(contexts)
    if host_contexts is not None and np.array_equal(host_contexts, host_segments):
        contexts = host_contexts = None  # every document on its own
    if host_contexts is not None and (not causal or prefix_len is not None):
        raise ValueError("shared contexts are a causal mask without a bidirectional prefix")
    if host_contexts is None and host_segments is not None and (host_segments == host_segments[:, :1]).all():
        segments = host_segments = None  # one document per row: no segment check
    mask = AttentionMask(causal, segments, segments, prefix_len, contexts=contexts)
    if mask.is_simple:
        return mask
    if contexts is not None:
        return replace(mask, varlen=(context_varlen_problem(host_segments, host_contexts),) if varlen else None)
    return replace(
        mask,
        key_bounds=None if prefix_len is None else _key_bounds(prefix_len),
        varlen=varlen_problems(causal, host_segments, _numpy(prefix_len), shape) if varlen else None,
    )


def _key_bounds(prefix_len: torch.Tensor) -> np.ndarray:
    """Per query position, the largest prefix end over the batch: host [T] ([1] for [B] prefixes)."""
    ends = _numpy(prefix_len)
    return ends.reshape(-1, 1).max(axis=0) if ends.ndim == 1 else ends.max(axis=0)


def varlen_problems(
    causal: bool, segments: np.ndarray | None, prefix_len: np.ndarray | None, shape: tuple[int, int]
) -> tuple[VarlenProblem, ...]:
    """Self-attention as flash-attn varlen problems (host arrays in, CPU tensors out).

    Every run of equal segment ids in a row is one sequence (a row without segments is one run), attending
    causally or bidirectionally. With a prefix (causal only), each run ``[s, e)`` with prefix end ``p``
    (clamped into the run) is two problems: its prefix queries ``[s, p)`` attend bidirectionally to its
    prefix keys; its other queries ``[p, e)`` attend causally, bottom-right aligned, to all its keys
    ``[s, e)``, so query ``i`` sees keys up to ``i`` (flash-attn's alignment puts the last query on the last
    key). A run that is all prefix or has no prefix takes part in one problem only: no problem holds a
    sequence without queries (see :func:`_problem`).
    """
    batch, length = shape
    if segments is None:
        segments = np.ones((batch, length), dtype=np.int64)
    starts, ends = _runs(segments)  # flattened [s, e) of every run, in order
    if prefix_len is None or not causal:
        return (_problem(ends - starts, ends - starts, causal),)
    row = starts // length
    run_prefix = prefix_len[row] if prefix_len.ndim == 1 else prefix_len.reshape(-1)[starts]
    split = np.clip(row * length + run_prefix, starts, ends)  # flattened prefix end of each run
    problems = []
    has_prefix = split > starts
    if has_prefix.any():
        lengths = (split - starts)[has_prefix]
        index = _ranges(starts[has_prefix], split[has_prefix])
        problems.append(_problem(lengths, lengths, False, index, index))
    has_suffix = ends > split
    if has_suffix.any():
        starts, split, ends = starts[has_suffix], split[has_suffix], ends[has_suffix]
        problems.append(
            _problem(
                ends - split,
                ends - starts,
                True,
                _ranges(split, ends),
                _unless_all(_ranges(starts, ends), batch * length),
            )
        )
    return tuple(problems)


def context_varlen_problem(segments: np.ndarray, contexts: np.ndarray) -> VarlenProblem:
    """Causal self-attention of documents that continue a shared context as one varlen problem: every run of
    equal segment ids is a sequence of queries, in order; its keys are the run of the segment it continues
    (``contexts``, where that names another segment of its row), then its own, so that causal bottom-right
    alignment shows each query its context and its own earlier keys."""
    batch, length = segments.shape
    starts, ends = _runs(segments)
    flat_segments, flat_contexts = segments.reshape(-1), contexts.reshape(-1)
    base = int(max(segments.max(initial=0), contexts.max(initial=0))) + 1
    row = starts // length
    run_keys, context_keys = row * base + flat_segments[starts], row * base + flat_contexts[starts]
    continues = context_keys != run_keys
    order = np.argsort(run_keys, kind="stable")
    found = order[np.minimum(np.searchsorted(run_keys[order], context_keys), len(order) - 1)]
    if (continues & (run_keys[found] != context_keys)).any():
        raise ValueError("a document continues a context segment that is not in its row")
    context_starts = np.where(continues, starts[found], starts)
    context_ends = np.where(continues, ends[found], starts)  # (an empty range: no context)
    keys = _ranges(np.stack([context_starts, starts], 1).reshape(-1), np.stack([context_ends, ends], 1).reshape(-1))
    lengths = ends - starts
    return _problem(lengths, lengths + context_ends - context_starts, True, None, _unless_all(keys, batch * length))


def cross_varlen_problem(q_segments: np.ndarray, kv_segments: np.ndarray) -> VarlenProblem:
    """Packed cross-attention as one varlen problem: queries of segment ``s`` of row ``b`` attend to the keys
    of segment ``s`` of row ``b``, both gathered into (row, segment) order. Padding queries (segment 0) attend
    to the padding keys, or to none (flash-attn writes zeros): their outputs carry no loss. Keys of a segment
    without queries are left out (see :func:`_problem`)."""
    base = int(max(q_segments.max(initial=0), kv_segments.max(initial=0))) + 1
    q_keys = (np.arange(q_segments.shape[0])[:, None] * base + q_segments).reshape(-1)
    k_keys = (np.arange(kv_segments.shape[0])[:, None] * base + kv_segments).reshape(-1)
    groups = np.unique(q_keys)
    k_kept = np.flatnonzero(np.isin(k_keys, groups))
    q_count = np.bincount(np.searchsorted(groups, q_keys), minlength=len(groups))
    k_count = np.bincount(np.searchsorted(groups, k_keys[k_kept]), minlength=len(groups))
    q_order = np.argsort(q_keys, kind="stable")
    k_order = k_kept[np.argsort(k_keys[k_kept], kind="stable")]
    return _problem(q_count, k_count, False, _unless_all(q_order, len(q_keys)), _unless_all(k_order, len(k_keys)))


def _unless_all(positions: np.ndarray, total: int) -> np.ndarray | None:
    """``positions``, or None when they are 0..total-1 in order (no gather needed)."""
    return None if np.array_equal(positions, np.arange(total)) else positions


def _runs(segments: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Flattened start and end of every run of equal ids in each row."""
    batch, length = segments.shape
    is_start = np.ones_like(segments, dtype=bool)
    is_start[:, 1:] = segments[:, 1:] != segments[:, :-1]
    starts = np.flatnonzero(is_start)
    return starts, np.append(starts[1:], batch * length)


def _ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The concatenation of arange(s, e) for every pair."""
    return (
        np.concatenate([np.arange(s, e) for s, e in zip(starts.tolist(), ends.tolist())])
        if len(starts)
        else np.zeros(0, dtype=np.int64)
    )


def _problem(
    q_lengths: np.ndarray,
    k_lengths: np.ndarray,
    causal: bool,
    q_index: np.ndarray | None = None,
    k_index: np.ndarray | None = None,
) -> VarlenProblem:
    """The problem of sequences with these lengths; every sequence holds a query. flash-attn's kernel for
    ``max_seqlen_q == 1`` with grouped-query heads (its "ngroups swapped" path) folds the query heads into
    the sequence axis assuming exactly one query per sequence, and fails on a sequence without one.
    """

    def cumulative(lengths: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))

    def index(positions: np.ndarray | None) -> torch.Tensor | None:
        return None if positions is None else torch.from_numpy(np.asarray(positions, dtype=np.int64))

    return VarlenProblem(
        cumulative(q_lengths),
        cumulative(k_lengths),
        int(q_lengths.max(initial=0)),
        int(k_lengths.max(initial=0)),
        causal,
        index(q_index),
        index(k_index),
    )


def _numpy(tensor: torch.Tensor | None) -> np.ndarray | None:
    return None if tensor is None else tensor.detach().cpu().numpy()


def to_device(
    tensor: torch.Tensor | None, device: torch.device | str, moved: Mapping[int, torch.Tensor] | None = None
) -> torch.Tensor | None:
    """Host -> device without waiting (from page-locked memory on CUDA; a tensor not yet pinned is pinned);
    a tensor in ``moved`` (by id) is already there and not copied again."""
    target = torch.device(device)
    if tensor is None or tensor.device == target:
        return tensor
    if moved is not None and id(tensor) in moved:
        return moved[id(tensor)]
    if target.type == "cuda" and not tensor.is_pinned():
        tensor = tensor.pin_memory()
    return tensor.to(target, non_blocking=True)
