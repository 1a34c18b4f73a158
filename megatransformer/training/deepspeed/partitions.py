"""Which elements of which parameter each rank holds, in the flat buffers DeepSpeed's optimizer steps: one map per
engine, at ZeRO-0 to 3 and with DeepSpeed's bf16 and fp16 optimizers. Read from DeepSpeed 0.19.8; how each stage
lays its partitions out: docs/architecture.md."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatransformer.training.deepspeed import internals


@dataclass(frozen=True)
class Fragment:
    """Elements ``start`` to ``start + numel`` of parameter ``name`` (flattened; this tensor-parallel rank's shard
    of it), which rank ``rank`` holds at ``offset`` of its optimizer's flat buffer number ``buffer``. The engine's
    low-precision partition of a ZeRO buffer holds the same elements at the same offsets."""

    rank: int
    tp_rank: int
    name: str
    start: int
    numel: int
    buffer: int
    offset: int


@dataclass(frozen=True)
class PartitionMap:
    """Every rank's fragments of every trainable parameter (``fragments``), each parameter's shape on its
    tensor-parallel rank (``shapes``), and this rank's flat buffers (``buffers``: the ``id`` of each tensor the
    torch optimizer steps, to its number; the same numbers on every rank). ZeRO-0 hands each rank every parameter
    whole, as one buffer each."""

    zero_stage: int
    world_size: int
    shapes: dict[str, torch.Size]
    fragments: tuple[Fragment, ...]
    buffers: dict[int, int]

    def of(self, names: set[str]) -> list[Fragment]:
        """The fragments of the parameters ``names``, every rank's, in the map's order."""
        return [f for f in self.fragments if f.name in names]


def build_partition_map(engine, inner: torch.optim.Optimizer, zero_stage: int, tp_rank: int) -> PartitionMap:
    """The map of ``engine``'s partitions (``inner``: the torch optimizer inside DeepSpeed's wrappers), this rank's
    fragments gathered from every rank once (an object all-gather over the world)."""
    names = {id(p): name for name, p in engine.module.named_parameters() if p.requires_grad}
    wrapper = engine.optimizer
    rank = dist.get_rank() if dist.is_initialized() else 0
    local: list[Fragment] = []
    buffers: dict[int, int] = {}
    shapes: dict[str, torch.Size] = {}
    if internals.is_zero3(wrapper):
        dp_rank = dist.get_rank(internals.zero3_group(wrapper))
        for number, (flat, params) in enumerate(internals.zero3_flat_groups(wrapper)):
            buffers[id(flat)] = number
            for param in params:
                shapes[names[id(param)]] = internals.zero3_shape(param)
                offset, part, numel = internals.zero3_place(wrapper, param)
                held = min(part, numel - dp_rank * part)
                if held > 0:
                    local.append(Fragment(rank, tp_rank, names[id(param)], dp_rank * part, held, number, offset))
    elif internals.is_flat_partitioned(wrapper):  # ZeRO-1/2, bf16 optimizer
        for number, (flat, params) in enumerate(internals.flat_partition_groups(wrapper)):
            buffers[id(flat)] = number
            for param in params:
                shapes[names[id(param)]] = param.shape
                mapping = internals.fragment_mapping(param)
                if mapping is not None:  # (None: wholly in other ranks' partitions)
                    lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
                    local.append(Fragment(rank, tp_rank, names[id(param)], lp.start, lp.numel, number, hp.start))
    else:  # ZeRO-0: whole parameters, or fp16/bf16 optimizers' fp32 masters of them
        masters = {id(master): param for param, master in internals.unfused_masters(wrapper)}
        stepped = [p for group in inner.param_groups for p in group["params"]]
        for number, tensor in enumerate(stepped):
            buffers[id(tensor)] = number
            name = names.get(id(masters.get(id(tensor), tensor)))
            if name is None:
                continue  # (FP16_Optimizer's flat fp32 master of a whole group: no parameter's own buffer)
            shapes[name] = tensor.shape
            local.append(Fragment(rank, tp_rank, name, 0, tensor.numel(), number, 0))
    world = dist.get_world_size() if dist.is_initialized() else 1
    every: list = [local]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, local)
    fragments = tuple(f for frags in every for f in frags)
    return PartitionMap(zero_stage, world, shapes, fragments, buffers)
