"""Which elements of which parameter each rank holds, in the flat buffers DeepSpeed's optimizer steps: one map per
engine, at ZeRO-0 to 3 and with DeepSpeed's bf16 and fp16 optimizers. Read from DeepSpeed 0.19.8; how each stage
lays its partitions out: docs/architecture.md."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    tensor-parallel rank (``shapes``), and this rank's flat buffers: ``tensors``, the fp32 tensors the torch
    optimizer steps (its state is keyed by them), by number, the same numbers on every rank; ``buffers``, the
    ``id`` of each to its number; ``groups``, the torch optimizer's parameter group each is stepped in. ZeRO-0
    hands each rank every parameter whole, as one buffer each (or, in DeepSpeed's fused fp16 optimizer, one flat
    master per group)."""

    zero_stage: int
    world_size: int
    rank: int
    shapes: dict[str, torch.Size]
    fragments: tuple[Fragment, ...]
    buffers: dict[int, int]
    tensors: tuple[torch.Tensor, ...] = field(repr=False, compare=False)
    groups: tuple[int, ...]

    def of(self, names: set[str]) -> list[Fragment]:
        """The fragments of the parameters ``names``, every rank's, in the map's order."""
        return [f for f in self.fragments if f.name in names]

    def mine(self) -> list[Fragment]:
        """This rank's fragments."""
        return [f for f in self.fragments if f.rank == self.rank]


def build_partition_map(engine, inner: torch.optim.Optimizer, zero_stage: int, tp_rank: int) -> PartitionMap:
    """The map of ``engine``'s partitions (``inner``: the torch optimizer inside DeepSpeed's wrappers), this rank's
    fragments gathered from every rank once (an object all-gather over the world)."""
    names = {id(p): name for name, p in engine.module.named_parameters() if p.requires_grad}
    wrapper = engine.optimizer
    rank = dist.get_rank() if dist.is_initialized() else 0
    local: list[Fragment] = []
    tensors: list[torch.Tensor] = []
    groups: list[int] = []
    shapes: dict[str, torch.Size] = {}
    group_of = {id(p): number for number, group in enumerate(inner.param_groups) for p in group["params"]}
    if internals.is_zero3(wrapper):
        dp_rank = dist.get_rank(internals.zero3_group(wrapper))
        for number, (flat, params, group) in enumerate(internals.zero3_flat_groups(wrapper)):
            tensors.append(flat)
            groups.append(group)
            for param in params:
                shapes[names[id(param)]] = internals.zero3_shape(param)
                offset, part, numel = internals.zero3_place(wrapper, param)
                held = min(part, numel - dp_rank * part)
                if held > 0:
                    local.append(Fragment(rank, tp_rank, names[id(param)], dp_rank * part, held, number, offset))
    elif internals.is_flat_partitioned(wrapper):  # ZeRO-1/2, bf16 optimizer
        for number, (flat, params) in enumerate(internals.flat_partition_groups(wrapper)):
            tensors.append(flat)
            groups.append(group_of[id(flat)])
            for param in params:
                shapes[names[id(param)]] = param.shape
                mapping = internals.fragment_mapping(param)
                if mapping is not None:  # (None: wholly in other ranks' partitions)
                    lp, hp = mapping.lp_fragment_address, mapping.hp_fragment_address
                    local.append(Fragment(rank, tp_rank, names[id(param)], lp.start, lp.numel, number, hp.start))
    else:  # ZeRO-0: whole parameters, or fp16/bf16 optimizers' fp32 masters of them
        masters = {id(master): [param] for param, master in internals.unfused_masters(wrapper)}
        masters |= {id(flat): params for flat, params in internals.fused_masters(wrapper)}
        stepped = [(p, number) for number, group in enumerate(inner.param_groups) for p in group["params"]]
        for number, (tensor, group) in enumerate(stepped):
            tensors.append(tensor)
            groups.append(group)
            offset = 0
            for param in masters.get(id(tensor), [tensor]):
                if id(param) in names:
                    shapes[names[id(param)]] = param.shape
                    local.append(Fragment(rank, tp_rank, names[id(param)], 0, param.numel(), number, offset))
                offset += param.numel()
    world = dist.get_world_size() if dist.is_initialized() else 1
    every: list = [local]
    if world > 1:
        every = [None] * world
        dist.all_gather_object(every, local)
    fragments = tuple(f for frags in every for f in frags)
    buffers = {id(t): number for number, t in enumerate(tensors)}
    return PartitionMap(zero_stage, world, rank, shapes, fragments, buffers, tuple(tensors), tuple(groups))
