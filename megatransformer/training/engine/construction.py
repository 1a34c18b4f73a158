"""The model a run trains, built where it runs: at ZeRO-3 partitioned as it is made (``deepspeed.zero.Init``),
each parameter's values written once, whole, by one rank and spread; weights a run starts from (``init_from``)
loaded the same way, one tensor at a time. Every layout gets the weights of the one-rank build of the seed
(``transformer.init_weights``). Design: docs/architecture.md, "Building the model"."""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from megatransformer.config import RunConfig
from megatransformer.model import ARCHITECTURES
from megatransformer.model.transformer import init_weights
from megatransformer.training.deepspeed.internals import zero3_param_group


def partitions_at_construction(cfg: RunConfig, zero_stage: int) -> bool:
    """Whether the model is built partitioned: ZeRO-3 without tensor parallelism (AutoTP shards a whole model);
    otherwise the model is built whole on every rank and partitioned by ``deepspeed.initialize``."""
    return zero_stage == 3 and cfg.parallel.tensor_parallel == 1


def build_for_run(
    cfg: RunConfig, zero_stage: int, ds_config: dict[str, Any], device: torch.device | str = "cpu"
) -> nn.Module:
    """The initialised model of ``cfg``, on the run's ``device``: partitioned over all ranks (the ZeRO-3 group
    without tensor parallelism, sequence-parallel peers included) in the run's precision where
    :func:`partitions_at_construction`, else whole in fp32 (DeepSpeed casts it). torch's generators are left
    seeded with ``cfg.seed`` either way (dropout draws alike on every layout)."""
    if partitions_at_construction(cfg, zero_stage):
        import deepspeed

        config = copy.deepcopy(ds_config)
        # (else DeepSpeed replaces torch.nn.functional.linear for good, with a product that rounds otherwise)
        config["zero_optimization"]["memory_efficient_linear"] = False
        # the dtype is the config's (bf16, fp16 or fp32, as precision): DeepSpeed 0.19.8 reads an explicit fp32
        # ``dtype`` as bf16 where the accelerator has no fp16 (`_set_dtype`: `dtype or fp16 if ... else bf16`)
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = ARCHITECTURES[cfg.model.arch](cfg.model)
        init_weights(model, cfg.model, cfg.seed, fill=fill_partitioned)
    else:
        with torch.device(device):  # (the host holds one block of initial values at a time, never the model)
            model = ARCHITECTURES[cfg.model.arch](cfg.model)
        init_weights(model, cfg.model, cfg.seed)
    torch.manual_seed(cfg.seed)
    return model


_writes = 0  # parameters written by fill_partitioned so far: which rank writes the next one


def fill_partitioned(param: nn.Parameter, write: Callable[[torch.Tensor], None]) -> None:
    """Write ZeRO-3 parameter ``param`` whole: gathered on every rank, written by one (in turn, so the writing is
    shared), broadcast and partitioned again. A collective: every rank calls it for the same parameters."""
    global _writes
    import deepspeed

    group = zero3_param_group(param)
    writer = _writes % dist.get_world_size(group)
    _writes += 1
    with deepspeed.zero.GatheredParameters([param], modifier_rank=writer), torch.no_grad():
        if dist.get_rank(group) == writer:
            write(param.data)


def load_into_partitioned(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """``weights`` (names of the model's state to tensors, perhaps read on lookup) into ZeRO-3 ``model``, one
    tensor at a time: each read only by the rank that writes it; a missing or an extra name is an error."""
    params = dict(model.named_parameters())  # (a tied parameter once, under its first name)
    names = set(model.state_dict(keep_vars=True))
    missing, extra = sorted(names - set(weights)), sorted(set(weights) - names)
    if missing or extra:
        raise ValueError(f"the weights do not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, param in params.items():

        def write(whole: torch.Tensor, name: str = name) -> None:
            whole.copy_(weights[name])

        fill_partitioned(param, write)
    buffers = {name for name, _ in model.named_buffers()} & names
    with torch.no_grad():
        for name in sorted(buffers):
            model.get_buffer(name).copy_(weights[name])
