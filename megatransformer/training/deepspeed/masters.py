"""This rank's fp32 state, found through the partition map: each of its fragments' live elements in the fp32
masters and in the optimizer's state, and the model's weights made again from the masters."""

from __future__ import annotations

import torch

from megatransformer.training.deepspeed import internals
from megatransformer.training.deepspeed.partitions import Fragment, PartitionMap


def fragment_master(partitions: PartitionMap, fragment: Fragment) -> torch.Tensor:
    """The live elements of this rank's ``fragment`` in its fp32 master: a view, writing it writes the master."""
    return _elements(partitions.tensors[fragment.buffer], fragment)


def fragment_state(
    partitions: PartitionMap, fragment: Fragment, optimizer: torch.optim.Optimizer, key: str
) -> torch.Tensor | None:
    """The live elements of this rank's ``fragment`` in the torch ``optimizer``'s state ``key`` (a view, as
    :func:`fragment_master`); None where the optimizer keeps no such state for its buffer, as Muon keeps no Adam
    moments for its matrices."""
    flat = partitions.tensors[fragment.buffer]
    state = optimizer.state.get(flat, {}).get(key)
    if not torch.is_tensor(state) or state.shape != flat.shape:
        return None
    return _elements(state, fragment)


def _elements(buffer: torch.Tensor, fragment: Fragment) -> torch.Tensor:
    return buffer.detach().reshape(-1).narrow(0, fragment.offset, fragment.numel)


def weights_from_masters(engine, partitions: PartitionMap) -> None:
    """The model's weights from the fp32 masters, wherever the layout keeps them apart: ZeRO-3's partitions,
    ZeRO-1/2's and the bf16 optimizer's flat groups, ZeRO-0's fp16/bf16 masters. A collective."""
    wrapper = engine.optimizer
    if internals.is_zero3(wrapper):
        internals.zero3_weights_from_masters(wrapper)
    elif internals.is_flat_partitioned(wrapper):  # ZeRO-1/2, bf16 optimizer
        internals.flat_partitions_to_weights(wrapper)
    else:
        params = dict(engine.module.named_parameters())
        with torch.no_grad():
            for fragment in partitions.mine():
                param = params[fragment.name]
                if partitions.tensors[fragment.buffer] is not param:  # (fp32: the weights are the masters)
                    param.copy_(fragment_master(partitions, fragment).view_as(param))
