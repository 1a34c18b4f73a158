"""Every use of a private attribute of DeepSpeed, read from DeepSpeed 0.19.8: check each of these on an upgrade.

DeepSpeed's public fragment API (``deepspeed.utils.safe_get_local_*``) names a parameter's piece of the state but
not where that piece lies in the parameter, which a checkpoint that reshards must know; these functions say it.
(``bf16_step.py`` replaces one DeepSpeed method whole, against the same version.)"""

from __future__ import annotations

import functools
import importlib

import torch
import torch.distributed as dist


def data_parallel_rank() -> int:
    """This rank's index in its data-parallel group, as DeepSpeed's groups count it (with tensor parallelism)."""
    from deepspeed.utils import groups

    return groups._get_data_parallel_rank()


def is_fragment_mapped(param: torch.Tensor) -> bool:
    """Whether ZeRO-1/2 or the bf16 optimizer maps ``param`` to the flat partitions (its mapping may be None:
    wholly in other ranks' partitions)."""
    return hasattr(param, "_hp_mapping")


def fragment_mapping(param: torch.Tensor):
    """ZeRO-1/2's and the bf16 optimizer's map of the piece of ``param`` this rank's partition holds
    (``lp_fragment_address``, ``hp_fragment_address``, ``hp_fragment``, ``get_optim_state_fragment``); None when
    it holds none."""
    return getattr(param, "_hp_mapping", None)


def relink_fragment_state(optimizer) -> None:
    """Map every parameter to its piece of the optimizer state again (ZeRO-1/2, bf16 optimizer; a no-op for
    others): DeepSpeed maps them once, after the first group's step, so the other groups' are never mapped."""
    link = getattr(optimizer, "_lazy_init_hp_params_optimizer_state", None)
    if link is not None:
        optimizer._hp_optimizer_states_linked = False
        link()


def zero3_partition(param: torch.Tensor) -> tuple[object, int, int]:
    """ZeRO-3: (the optimizer that partitions ``param``, the first element of it this rank holds, the partition's
    size)."""
    optimizer = param._z3_optimizer
    size = param.ds_tensor.ds_numel
    return optimizer, optimizer._get_param_partition_rank(param) * size, size


def zero3_fp32_state(optimizer, param: torch.Tensor, key: str | None) -> torch.Tensor:
    """ZeRO-3: this rank's fp32 partition of ``param``'s master (``key`` None) or optimizer state ``key``, swapped in
    if offloaded to NVMe."""
    return optimizer._get_fp32_opt_state_partition(param, release_swap_buffers=True, optim_state_key=key)[0]


def zero3_refresh_partitions(optimizer) -> None:
    """ZeRO-3: each sub-group's low-precision partitions from its fp32 masters."""
    for group in range(len(optimizer.fp32_partitioned_groups_flat)):
        optimizer._reassign_or_swap_out_partitioned_parameters(group)


# ------------------------------------------------------------------------------------ partitions (partitions.py)


def is_zero3(optimizer) -> bool:
    """Whether ``optimizer`` is ZeRO-3's (DeepSpeed 0.19.8: ``fp32_partitioned_groups_flat``)."""
    return hasattr(optimizer, "fp32_partitioned_groups_flat")


def zero3_group(optimizer) -> dist.ProcessGroup:
    """ZeRO-3: the group each parameter is partitioned over (0.19.8: ``dp_process_group``)."""
    return optimizer.dp_process_group


def zero3_flat_groups(optimizer) -> list[tuple[torch.Tensor, list[torch.Tensor]]]:
    """ZeRO-3: each sub-group's flat fp32 partition and its parameters (0.19.8: ``fp32_partitioned_groups_flat``,
    ``fp16_groups``)."""
    return list(zip(optimizer.fp32_partitioned_groups_flat, optimizer.fp16_groups))


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


def unfused_masters(optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """ZeRO-0 with fp16/bf16: (parameter, its fp32 master) where DeepSpeed's FP16_UnfusedOptimizer keeps one master
    per parameter (0.19.8: ``fp16_groups``, ``fp32_groups``); none for other optimizers."""
    if not hasattr(optimizer, "fp32_groups") or not hasattr(optimizer, "fp16_groups"):
        return []
    return [(p, m) for ps, ms in zip(optimizer.fp16_groups, optimizer.fp32_groups) for p, m in zip(ps, ms)]


# ------------------------------------------------------------------------------------ checkpoints (checkpointer.py)


def is_zero3_param(param: torch.Tensor) -> bool:
    """Whether ZeRO-3 partitions ``param`` (0.19.8: ``ds_id``)."""
    return hasattr(param, "ds_id")


def is_gathered(param: torch.Tensor) -> bool:
    """ZeRO-3: whether ``param`` holds its whole values now (0.19.8: ``ds_status``)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return param.ds_status == ZeroParamStatus.AVAILABLE


def zero3_param_group(param: torch.Tensor) -> dist.ProcessGroup:
    """ZeRO-3: the group ``param`` is partitioned over (0.19.8: ``ds_process_group``)."""
    return param.ds_process_group


def param_shape(param: torch.Tensor) -> torch.Size:
    """``param``'s shape, also where ZeRO-3 keeps it aside (0.19.8: ``ds_shape``)."""
    return getattr(param, "ds_shape", param.shape)


def zero3_sub_group_flat(optimizer, param: torch.Tensor) -> torch.Tensor:
    """ZeRO-3: the flat fp32 partition of the sub-group ``param`` is in (0.19.8: ``fp32_partitioned_groups_flat``,
    ``grad_position``, ``get_param_id``)."""
    return optimizer.fp32_partitioned_groups_flat[optimizer.grad_position[optimizer.get_param_id(param)][0]]


def zero3_flats_and_groups(optimizer) -> list[tuple[torch.Tensor, int]]:
    """ZeRO-3: each sub-group's flat fp32 partition and the number of the parameter group it belongs to (0.19.8:
    ``fp32_partitioned_groups_flat``, ``sub_group_to_group_id``)."""
    group_of = optimizer.sub_group_to_group_id
    return [(flat, group_of[i]) for i, flat in enumerate(optimizer.fp32_partitioned_groups_flat)]


def flat_partitions_to_weights(optimizer) -> None:
    """ZeRO-1/2, bf16 optimizer: the low-precision weights from the flat fp32 partitions (0.19.8:
    ``update_lp_params``)."""
    optimizer.update_lp_params()


def fp16_optimizer_masters(optimizer, key: str | None = None) -> dict[int, torch.Tensor]:
    """bf16/fp16 without ZeRO: DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer keep fp32 masters (one flat
    tensor, or one tensor per parameter, per group) that DeepSpeed's fragment API does not know about; map each
    low-precision parameter to its master, or with ``key`` to the master's optimizer state ``key`` (views: writing
    them writes the state; masters without that state yet are left out). (0.19.8: ``fp16_groups``,
    ``fp32_groups_flat``, ``fp32_groups``.)"""
    from torch._utils import _unflatten_dense_tensors

    low = getattr(optimizer, "fp16_groups", None)
    if low is None:
        return {}

    def state_of(master: torch.Tensor) -> torch.Tensor | None:
        return master if key is None else optimizer.optimizer.state.get(master, {}).get(key)

    if hasattr(optimizer, "fp32_groups_flat"):
        flats = [state_of(f) for f in optimizer.fp32_groups_flat]
        high = [
            [None] * len(params) if f is None else _unflatten_dense_tensors(f, params) for f, params in zip(flats, low)
        ]
    else:
        high = [[state_of(m) for m in masters] for masters in getattr(optimizer, "fp32_groups", [])]
    return {
        id(p): master for params, masters in zip(low, high) for p, master in zip(params, masters) if master is not None
    }


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
