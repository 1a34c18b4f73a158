"""Every use of a private attribute of DeepSpeed, read from DeepSpeed 0.19.8: check each of these on an upgrade.

DeepSpeed's public fragment API (``deepspeed.utils.safe_get_local_*``) names a parameter's piece of the state but
not where that piece lies in the parameter, which a checkpoint that reshards must know; these functions say it.
(``bf16_step.py`` replaces one DeepSpeed method whole, against the same version.)"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn


def data_parallel_rank() -> int:
    """This rank's index in its data-parallel group, as DeepSpeed's groups count it (with tensor parallelism)."""
    from deepspeed.utils import groups

    return groups._get_data_parallel_rank()


# ------------------------------------------------------------------------------------ partitions (partitions.py)


def is_zero3(optimizer) -> bool:
    """Whether ``optimizer`` is ZeRO-3's (DeepSpeed 0.19.8: ``fp32_partitioned_groups_flat``)."""
    return hasattr(optimizer, "fp32_partitioned_groups_flat")


def zero3_group(optimizer) -> dist.ProcessGroup:
    """ZeRO-3: the group each parameter is partitioned over (0.19.8: ``dp_process_group``)."""
    return optimizer.dp_process_group


def zero3_flat_groups(optimizer) -> list[tuple[torch.Tensor, list[torch.Tensor], int]]:
    """ZeRO-3: each sub-group's flat fp32 partition, its parameters and the number of the torch optimizer's
    parameter group it is stepped in (0.19.8: ``fp32_partitioned_groups_flat``, ``fp16_groups``,
    ``sub_group_to_group_id``)."""
    flats, group_of = optimizer.fp32_partitioned_groups_flat, optimizer.sub_group_to_group_id
    return [(flat, params, group_of[i]) for i, (flat, params) in enumerate(zip(flats, optimizer.fp16_groups))]


def zero3_shape(param: torch.Tensor) -> torch.Size:
    """ZeRO-3: a partitioned parameter's shape (0.19.8: ``ds_shape``)."""
    return param.ds_shape


def zero3_place(optimizer, param: torch.Tensor) -> tuple[int, int, int]:
    """ZeRO-3: (where in its sub-group's flat partition the rank's part of ``param`` lies, the part's size, the
    parameter's size); rank r holds elements r x part on (0.19.8: ``grad_position``, ``get_param_id``,
    ``ds_numel``)."""
    _, offset, part = optimizer.grad_position[optimizer.get_param_id(param)]
    return offset, part, param.ds_numel


def is_flat_partitioned(optimizer) -> bool:
    """Whether ``optimizer`` flattens each group and gives each rank one contiguous partition: ZeRO-1/2's and the
    bf16 optimizer (0.19.8: ``single_partition_of_fp32_groups``, ``fp32_groups_flat_partition``)."""
    return hasattr(optimizer, "single_partition_of_fp32_groups") or hasattr(optimizer, "fp32_groups_flat_partition")


def flat_partition_groups(optimizer) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """ZeRO-1/2, bf16 optimizer: each group's flat fp32 partition and its low-precision parameters (0.19.8:
    ``single_partition_of_fp32_groups`` and ``bit16_groups``; ``fp32_groups_flat_partition`` and ``bf16_groups``)."""
    flats = getattr(optimizer, "single_partition_of_fp32_groups", None) or optimizer.fp32_groups_flat_partition
    lows = getattr(optimizer, "bit16_groups", None) or optimizer.bf16_groups
    return list(zip(flats, lows))


def fragment_mapping(param: torch.Tensor):
    """ZeRO-1/2's and the bf16 optimizer's map of the piece of ``param`` this rank's partition holds: where it lies
    in ``param`` (``lp_fragment_address``) and in the partition (``hp_fragment_address``); None when it holds none
    (0.19.8: ``_hp_mapping``)."""
    return getattr(param, "_hp_mapping", None)


def unfused_masters(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ZeRO-0 with fp16/bf16: (parameter, its fp32 master) where DeepSpeed's FP16_UnfusedOptimizer keeps one master
    per parameter (0.19.8: ``fp16_groups``, ``fp32_groups``); none for other optimizers."""
    if not hasattr(optimizer, "fp32_groups") or not hasattr(optimizer, "fp16_groups"):
        return []
    return [(p, m) for ps, ms in zip(optimizer.fp16_groups, optimizer.fp32_groups) for p, m in zip(ps, ms)]


def fused_masters(optimizer) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """ZeRO-0 with fp16: (a group's flat fp32 master, the parameters it holds one after another) where DeepSpeed's
    FP16_Optimizer keeps one master per group (0.19.8: ``fp32_groups_flat``, ``fp16_groups``); none for other
    optimizers."""
    if not hasattr(optimizer, "fp32_groups_flat") or not hasattr(optimizer, "fp16_groups"):
        return []
    return list(zip(optimizer.fp32_groups_flat, optimizer.fp16_groups))


# ------------------------------------------------------------------------------------ parameters (ZeRO-3)


def is_zero3_param(param: torch.Tensor) -> bool:
    """Whether ZeRO-3 partitions ``param`` (0.19.8: ``ds_id``)."""
    return hasattr(param, "ds_id")


def is_gathered(param: torch.Tensor) -> bool:
    """ZeRO-3: whether ``param`` holds its whole values now (0.19.8: ``ds_status``)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param.ds_status == ZeroParamStatus.AVAILABLE


def zero3_partition(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """ZeRO-3: this rank's partition of ``param`` and the index of its first element in the flattened parameter
    (0.19.8: ``ds_tensor``, equal parts of the parameter padded to a multiple of its group's size, in rank order;
    the padding past ``ds_numel`` is no parameter's)."""
    part = param.ds_tensor
    return part, dist.get_rank(param.ds_process_group) * part.numel()


def param_shape(param: torch.Tensor) -> torch.Size:
    """``param``'s shape, also where ZeRO-3 keeps it aside (0.19.8: ``ds_shape``)."""
    return getattr(param, "ds_shape", param.shape)


Partition = Callable[[list[nn.Parameter]], None]


def zero3_init_unwritten(**kwargs):
    """``deepspeed.zero.Init(**kwargs)``, whose parameters are partitioned as they are, unwritten: each rank cuts
    its partition out of its own values, and no rank broadcasts them (0.19.8: ``_zero_init_param`` broadcasts each
    parameter whole from the group's first rank first). For parameters that hold equal values on every rank (a
    norm's ones), or whose partitions each rank writes afterwards (``construction.draw_own_partition``); the
    function it binds to each parameter to partition others (:func:`partitioner_of`) partitions alike."""
    return _unwritten_init_class()(**kwargs)


@functools.cache
def _unwritten_init_class() -> type:
    import deepspeed

    class PartitionedUnwritten(deepspeed.zero.Init):
        def _zero_init_param(self, param: nn.Parameter) -> None:
            self._convert_to_deepspeed_param(param)
            param.partition()

    return PartitionedUnwritten


def zero3_partitioner(group: dist.ProcessGroup, ds_config: dict) -> Partition:
    """A function that partitions whole parameters over ``group`` as ZeRO-3 does those made in
    :func:`zero3_init_unwritten` (each cut as it is, unwritten; its device and dtype kept). A collective: every rank
    of ``group`` partitions the same parameters in the same order (0.19.8: ``Init``, not entered, so that it patches
    no constructor and leaves ``torch.nn.functional.linear`` as it is, and its ``_convert_to_zero_parameters``,
    which the engine also uses for parameters made whole)."""
    from deepspeed.utils import groups

    init = zero3_init_unwritten(data_parallel_group=group, config_dict_or_path=ds_config, mpu=groups)
    return init._convert_to_zero_parameters


def partitioner_of(param: torch.Tensor) -> Partition:
    """ZeRO-3: the function that partitions whole parameters as ``param`` was, over its group (0.19.8:
    ``convert_to_zero_parameters``, as the engine partitions a model's parameters made after the others)."""
    return param.convert_to_zero_parameters


# ------------------------------------------------------------------------------------ groups (construction.py)


def tensor_parallel_groups(tensor_parallel: int) -> dist.ProcessGroup:
    """DeepSpeed's tensor- and data-parallel groups for ``tensor_parallel``, made now if they are not yet (the ones
    ``deepspeed.initialize``'s AutoTP then finds and uses); returns the data-parallel group, which ZeRO-3
    partitions over (0.19.8: ``groups._init_tp_mesh_device``, which the engine calls and which does nothing once
    the groups exist)."""
    from deepspeed.utils import groups

    groups._init_tp_mesh_device(tensor_model_parallel_size=tensor_parallel)
    return groups.get_data_parallel_group()


# ------------------------------------------------------------------------------------ AutoTP (construction.py)


def is_autotp_layer(module: nn.Module) -> bool:
    """Whether ``module`` is one of AutoTP's tensor-parallel layers, its parameters sliced to this rank's.

    DeepSpeed 0.19.8's AutoTP (``module_inject/auto_tp.py``, ``_replace_module``) builds each such layer
    (``layers.LinearLayer``, ``LinearAllreduce``: ``TensorParallel_Layer``) around the linear layer's own parameter
    objects, slices them in the layer's ``__init__`` (``_tp_partition``; a meta tensor stays on the meta device:
    ``TensorParallel_Layer.move``) and only then sets the layer in the linear one's place (``setattr``, which runs
    torch's module registration hooks)."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    return isinstance(module, TensorParallel_Layer)


# ------------------------------------------------------------------------------------ weights (masters.py)


def zero3_weights_from_masters(optimizer) -> None:
    """ZeRO-3: each sub-group's low-precision partitions from its fp32 masters, and the parameters it keeps whole
    (persistent) gathered again from them. A collective (0.19.8: ``persistent_parameters``,
    ``fp32_partitioned_groups_flat``, ``_reassign_or_swap_out_partitioned_parameters``)."""
    persistent = optimizer.persistent_parameters
    if persistent:
        persistent[0].partition(persistent)
    for group in range(len(optimizer.fp32_partitioned_groups_flat)):
        optimizer._reassign_or_swap_out_partitioned_parameters(group)
    if persistent:
        persistent[0].all_gather(persistent)


def flat_partitions_to_weights(optimizer) -> None:
    """ZeRO-1/2, bf16 optimizer: the low-precision weights from the flat fp32 partitions (0.19.8:
    ``update_lp_params``)."""
    optimizer.update_lp_params()


# ------------------------------------------------------------------------------------ start-up (train_module.py)


def import_own_muon_uncompiled() -> None:
    """Import DeepSpeed's own Muon module with its ``torch.compile`` deferred to each function's first call.

    Every ZeRO engine's start imports it (``zero/utils.is_zero_supported_optimizer``), and it compiles three
    functions as it loads (``runtime.compiler.compile()``), which loads Inductor: ~1.5 s of every rank's start. This
    trainer never calls them (its Muon is ``optimizers/muon.py``); a caller that does compiles them then."""
    import sys

    name = "deepspeed.runtime.zero.muon.muon_optimizer"
    if name in sys.modules:
        return
    from deepspeed.runtime import compiler

    def compile_at_first_call():
        def decorate(fn):
            compiled = None

            @functools.wraps(fn)
            def call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = torch.compile(fn)
                return compiled(*args, **kwargs)

            return call

        return decorate

    eager = compiler.compile
    compiler.compile = compile_at_first_call
    try:
        importlib.import_module(name)
    finally:
        compiler.compile = eager
