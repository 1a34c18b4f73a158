"""ZeRO-3's gathered weights kept out of autograd's saved tensors, so that a rank holds the weights of the modules
it is running, not the whole model, between its forward and backward passes.

A linear layer's product saves its weight for the backward pass as a view (``weight.t()``). ZeRO-3 frees a
gathered weight by giving the parameter an empty tensor, which frees nothing while such a view holds the gathered
storage: every weight of the model then stays gathered until the backward pass reaches it. DeepSpeed's own answer,
``memory_efficient_linear``, swaps ``torch.nn.functional.linear`` for a product of its own whose backward rounds
otherwise; here the views are saved as where they lie in their parameter, and made again, the same view of the same
values, from the weights ZeRO-3 gathers for the module's backward pass.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import NamedTuple

import torch

from megatransformer.training.deepspeed.internals import is_gathered, is_zero3_param


class WeightView(NamedTuple):
    """Where a saved tensor lies in a ZeRO-3 parameter's gathered values."""

    param: torch.nn.Parameter
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def _pack(tensor: torch.Tensor) -> torch.Tensor | WeightView:
    base = tensor._base
    if base is None or not is_zero3_param(base):
        return tensor
    return WeightView(base, tensor.size(), tensor.stride(), tensor.storage_offset() - base.storage_offset())


def _unpack(saved: torch.Tensor | WeightView) -> torch.Tensor:
    if not isinstance(saved, WeightView):
        return saved
    param = saved.param
    if not is_gathered(param):
        raise RuntimeError(f"a ZeRO-3 weight of shape {tuple(saved.size)} is read by the backward pass ungathered")
    return param.data.as_strided(saved.size, saved.stride, param.data.storage_offset() + saved.offset)


def weights_saved_by_place() -> AbstractContextManager:
    """The context of a ZeRO-3 forward pass: the views of gathered weights autograd saves are kept as their place in
    the parameter, and read from the gathered weights again in the backward pass."""
    return torch.autograd.graph.saved_tensors_hooks(_pack, _unpack)
