"""Ulysses sequence parallelism, applied to the model from the outside (docs/sequence_parallel.md).

The ranks of one sequence group read the same rows; each keeps a contiguous slice of every sequence axis
(:func:`local_part`) and runs embeddings, norms, MLPs and the loss on it. Around each attention module's core,
DeepSpeed's ``DistributedAttention`` exchanges slices of the sequence for slices of the heads (all-to-all), so
the core sees the whole sequence for ``heads / sp`` heads under the whole batch's masks (:class:`UlyssesCore`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from megatransformer.batch import IGNORE_INDEX, PAD_SEGMENT
from megatransformer.model.attention import Attention
from megatransformer.model.latent_attention import LatentAttention
from megatransformer.model.positions import Alibi

# the batch keys along each sequence axis of an architecture's batches, the axis's segment key first
SEQUENCE_AXES = (
    ("segment_ids", "input_ids", "position_ids", "prefix_len"),
    ("decoder_segment_ids", "decoder_input_ids", "decoder_position_ids"),
)
PAD_VALUES = {"segment_ids": PAD_SEGMENT, "decoder_segment_ids": PAD_SEGMENT, "labels": IGNORE_INDEX}


@functools.cache
def sequence_groups(size: int):
    """DeepSpeed's sequence-parallel groups (ranks r * size ... r * size + size - 1 share sequences), made once;
    the module is the ``mpu`` ``deepspeed.initialize`` takes so that ZeRO partitions and reduces over the
    sequence-data-parallel group (all ranks; the divisor: ``TrainModule.averaged_ranks``)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    parallel_state_sp.initialize_sequence_parallel(size)
    return parallel_state_sp


@dataclass(frozen=True)
class SequenceShard:
    """This rank's place in its sequence group: slice ``rank`` of ``size`` of every sequence."""

    rank: int
    size: int

    def split(self, batch: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The whole batch (sequence axes padded to a multiple of ``size``), from which the masks are built,
        and this rank's part of it, which the model runs on."""
        whole = pad_sequences(batch, self.size)
        return whole, local_part(whole, self.rank, self.size)


def pad_sequences(batch: Mapping[str, torch.Tensor], multiple: int) -> dict[str, torch.Tensor]:
    """``batch`` with each sequence axis padded at its end to a multiple of ``multiple``: padding segment,
    position 0, no loss. Only an axis with segment ids can grow (their padding segment keeps the new keys
    out of every real query's view); ``data.seq_len`` is a multiple already, an encoder-decoder's target
    length need not be."""
    out = dict(batch)
    for keys in SEQUENCE_AXES:
        present = [k for k in (*keys, "labels") if k in batch and _on_axis(batch, k, keys)]
        if not present:
            continue
        length = batch[present[0]].shape[1]
        extra = -length % multiple
        if not extra:
            continue
        if keys[0] not in batch:
            raise ValueError(
                f"a sequence of {length} positions without {keys[0]} cannot be padded to a multiple "
                f"of parallel.sequence_parallel={multiple}"
            )
        for key in present:
            out[key] = torch.nn.functional.pad(batch[key], (0, extra), value=PAD_VALUES.get(key, 0))
    return out


def local_part(batch: Mapping[str, torch.Tensor], rank: int, size: int) -> dict[str, torch.Tensor]:
    """Slice ``rank`` of ``size`` along every sequence axis of ``batch`` (whose lengths ``size`` divides):
    positions and prefix ends keep their whole-sequence values; one-per-row tensors stay whole."""
    out = dict(batch)
    for keys in SEQUENCE_AXES:
        for key in (*keys, "labels"):
            if key in batch and _on_axis(batch, key, keys):
                length = batch[key].shape[1] // size
                out[key] = batch[key][:, rank * length : (rank + 1) * length]
    return out


def _on_axis(batch: Mapping[str, torch.Tensor], key: str, keys: tuple[str, ...]) -> bool:
    """``key`` runs along the axis of ``keys``: one of them, or the labels of the last axis the batch has."""
    tensor = batch[key]
    if tensor.dim() != 2:
        return False
    if key != "labels":
        return key in keys
    decoder = "decoder_input_ids" in batch
    return keys[1] == ("decoder_input_ids" if decoder else "input_ids")


class UlyssesCore:
    """An attention core run on the whole sequence for this rank's share of the heads.

    Called as the core it wraps, on this rank's slice: q [B, H, T/sp, D], k and v [B, Hkv, Tk/sp, D].
    DeepSpeed's ``DistributedAttention`` turns them into [B, H/sp, T, D] and back; key/value heads fewer than
    ``sp`` are first repeated so each rank holds the one its query heads read (as ALST does). An ALiBi bias
    gets this rank's slopes and the positions of the whole sequence.
    """

    def __init__(self, core, group, rank: int, size: int) -> None:
        from deepspeed.sequence.layer import DistributedAttention

        self.core, self.group, self.rank, self.size = core, group, rank, size
        # [B, T, H, D]: heads (2) scattered, the sequence (1) gathered
        self.exchange = DistributedAttention(self._whole_sequence, group, scatter_idx=2, gather_idx=1)

    def __call__(self, q, k, v, mask, dropout: float, alibi: Alibi | None = None, **options) -> torch.Tensor:
        k, v = replicate_kv_heads(k, self.size), replicate_kv_heads(v, self.size)
        if alibi is not None:
            alibi = self._whole_sequence_alibi(alibi)
        out = self.exchange(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0, None, mask, dropout, alibi, **options
        )
        return out.transpose(1, 2)

    def _whole_sequence(self, q, k, v, mask, dropout, alibi, **options) -> torch.Tensor:
        out = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, dropout, alibi, **options)
        return out.transpose(1, 2)

    def _whole_sequence_alibi(self, alibi: Alibi) -> Alibi:
        heads = len(alibi.slopes) // self.size
        positions = all_gather_sequence(alibi.q_positions, self.group, self.size)
        keys = (
            positions
            if alibi.k_positions is alibi.q_positions
            else all_gather_sequence(alibi.k_positions, self.group, self.size)
        )
        return replace(alibi.heads(self.rank * heads, heads), q_positions=positions, k_positions=keys)


def replicate_kv_heads(x: torch.Tensor, size: int) -> torch.Tensor:
    """[B, Hkv, T, D] with each head repeated so that ``size`` ranks get at least one: Hkv < size (which
    ``size`` is a multiple of) becomes ``size`` heads; more heads are left as they are."""
    heads = x.shape[1]
    return x if heads >= size else x.repeat_interleave(size // heads, dim=1)


def all_gather_sequence(x: torch.Tensor, group, size: int) -> torch.Tensor:
    """The whole [B, T] from each rank's [B, T / size] slice (no gradient: positions)."""
    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)


def apply_ulysses(model: torch.nn.Module, group, rank: int, size: int) -> None:
    """Run every attention module's core through :class:`UlyssesCore` (the model's code is unchanged)."""
    for module in model.modules():
        if isinstance(module, (Attention, LatentAttention)):
            module.core = UlyssesCore(module.core, group, rank, size)


@contextmanager
def whole_sequences(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model`` with its attention cores as they were before :func:`apply_ulysses`: a rank runs whole sequences
    of its own, with every head, exchanging nothing with its sequence-parallel peers (each holds all the
    weights, or at ZeRO-3 gathers them as any forward does)."""
    wrapped = {m: m.core for m in model.modules() if isinstance(getattr(m, "core", None), UlyssesCore)}
    for module, ulysses in wrapped.items():
        module.core = ulysses.core
    try:
        yield model
    finally:
        for module, ulysses in wrapped.items():
            module.core = ulysses
