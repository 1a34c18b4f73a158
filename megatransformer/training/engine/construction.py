"""The model a run trains, built where it runs: at ZeRO-3 partitioned as it is made, each rank drawing the initial
values of its partitions alone; weights a run starts from (``init_from``) loaded one tensor at a time, each rank
reading its partitions alone. With tensor parallelism the linear layers' weights are made on the meta device,
AutoTP slices them there, and each rank then makes only its slices (:func:`slices_made_by_autotp`), at ZeRO-3
partitioned over the data-parallel ranks as each is made. Every layout gets the weights of the one-rank build of the
seed (``transformer.init_weights``). Design: docs/architecture.md, "Building the model"."""

from __future__ import annotations

import copy
import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from megatransformer.checkpoint import load_state
from megatransformer.config import RunConfig, precision_dtype
from megatransformer.model.tp_plan import partition_dim
from megatransformer.model.transformer import Draw, construct, draw_part_into, init_weights, initial_values
from megatransformer.training.deepspeed.internals import (
    Partition,
    is_autotp_layer,
    is_gathered,
    is_zero3_param,
    param_shape,
    partitioner_of,
    tensor_parallel_groups,
    zero3_init_unwritten,
    zero3_partition,
    zero3_partitioner,
)


def partitions_at_construction(cfg: RunConfig, zero_stage: int) -> bool:
    """Whether the model is built partitioned by ZeRO-3: over all ranks (``deepspeed.zero.Init``) without tensor
    parallelism, over the data-parallel ranks with it (:func:`partitioned_as_made`, its slices as AutoTP makes
    them: :func:`slices_made_by_autotp`). Below ZeRO-3 the model is built whole (its slices, with tensor
    parallelism)."""
    return zero_stage == 3


def build_for_run(
    cfg: RunConfig, zero_stage: int, ds_config: dict[str, Any], device: torch.device | str = "cpu"
) -> nn.Module:
    """The initialised model of ``cfg``, on the run's ``device``. Without tensor parallelism: partitioned over all
    ranks (the ZeRO-3 group, sequence-parallel peers included) in the run's precision where
    :func:`partitions_at_construction`, else whole in fp32 (DeepSpeed casts it). With tensor parallelism its linear
    layers' weights are on the meta device until ``deepspeed.initialize`` runs in :func:`slices_made_by_autotp`;
    the other parameters are whole in fp32, or at ZeRO-3 partitioned over the data-parallel ranks in the run's
    precision. torch's generators are left seeded with ``cfg.seed`` either way (dropout draws alike on every
    layout)."""
    tp = cfg.parallel.tensor_parallel
    if partitions_at_construction(cfg, zero_stage) and tp == 1:
        config = copy.deepcopy(ds_config)
        # (else DeepSpeed replaces torch.nn.functional.linear for good, with a product that rounds otherwise)
        config["zero_optimization"]["memory_efficient_linear"] = False
        # the dtype is the config's (bf16, fp16 or fp32, as precision): DeepSpeed 0.19.8 reads an explicit fp32
        # ``dtype`` as bf16 where the accelerator has no fp16 (`_set_dtype`: `dtype or fp16 if ... else bf16`)
        with zero3_init_unwritten(config_dict_or_path=config):
            model = construct(cfg.model)
        remake_buffers(model)
        init_weights(model, cfg.model, cfg.seed, fill=draw_own_partition)
    elif tp > 1:
        partition = None
        if partitions_at_construction(cfg, zero_stage):
            partition = cast_and_partitioned(
                zero3_partitioner(tensor_parallel_groups(tp), ds_config), precision_dtype(cfg.precision), device
            )
        partitioning = partitioned_as_made(partition) if partition else nullcontext()
        with torch.device(device), linear_weights_on_meta(), partitioning:
            model = construct(cfg.model)
        for prefix, module in model.named_modules():
            for name, param in list(module.named_parameters(recurse=False)):
                replicated = partition_dim(f"{prefix}.{name}" if prefix else name) is None
                if param.is_meta and replicated:  # (whole on every rank, or partitioned over the data-parallel)
                    made = replace_parameter(module, name, torch.empty(param.shape, device=device))
                    if partition:
                        partition([made])
        if partition:  # (the root module's own, set in no parent)
            partition([p for p in model.parameters() if not p.is_meta and not is_zero3_param(p)])
        # (the meta ones are left to slices_made_by_autotp)
        init_weights(model, cfg.model, cfg.seed, fill=draw_own_partition if partition else None)
    else:
        with torch.device(device):  # (the host holds a block of initial values a thread at a time, never the model)
            model = construct(cfg.model)
        init_weights(model, cfg.model, cfg.seed)
    torch.manual_seed(cfg.seed)
    return model


def remake_buffers(model: nn.Module) -> None:
    """Each module's buffers made again (``reset_buffers``) after ``deepspeed.zero.Init``, which casts every floating
    tensor made under it, torch.arange's too, to the run's precision: DeepSpeed leaves buffers as the model makes
    them otherwise, and a bf16 position table is wrong by up to 2."""
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()


def cast_and_partitioned(partition: Partition, dtype: torch.dtype, device: torch.device | str) -> Partition:
    """``partition``, each parameter first moved to ``device`` in ``dtype`` (the engine casts no parameter ZeRO-3
    partitioned before it)."""

    def cast_and_partition(params: list[nn.Parameter]) -> None:
        if not params:
            return
        for param in params:
            param.data = param.data.to(device=device, dtype=dtype)
        partition(params)

    return cast_and_partition


@contextmanager
def partitioned_as_made(partition: Partition) -> Iterator[None]:
    """Each module made in it has its parameters partitioned (``partition``) as it is set in its parent, its
    ``__init__`` done, as ``deepspeed.zero.Init`` partitions each module's at the end of its ``__init__``; those on
    the meta device are left. The caller partitions the root module's own. A collective: every rank of the
    partition's group makes the same modules."""

    def registered(parent: nn.Module, name: str, module: nn.Module | None) -> None:
        if module is not None:
            partition([p for p in module.parameters(recurse=False) if not p.is_meta and not is_zero3_param(p)])

    handle = torch.nn.modules.module.register_module_module_registration_hook(registered)
    try:
        yield
    finally:
        handle.remove()


def draw_own_partition(param: nn.Parameter, draw: Draw) -> None:
    """Draw ZeRO-3 parameter ``param``'s initial values into this rank's partition of it alone: no rank holds it
    whole, and no collective runs (every rank draws the values it keeps, at once)."""
    if is_gathered(param):
        raise RuntimeError("a ZeRO-3 parameter is gathered during the initialisation: its partition is not its value")
    partition, start = zero3_partition(param)
    draw(partition, param_shape(param), start)


def load_own_partition(param: nn.Parameter, weights: Mapping[str, torch.Tensor], name: str) -> None:
    """Read this rank's partition of ZeRO-3 parameter ``param`` from tensor ``name`` of ``weights`` alone (only its
    elements where ``weights`` reads flat ranges, ``checkpoint.LazyWeights.flat``): no collective runs, and the
    ranks read at once."""
    if is_gathered(param):
        raise RuntimeError("a ZeRO-3 parameter is gathered while weights are loaded: its partition is not its value")
    partition, start = zero3_partition(param)
    stop = min(start + partition.numel(), math.prod(param_shape(param)))
    if stop > start:
        partition[: stop - start].copy_(read_flat(weights, name, start, stop))


def read_flat(
    weights: Mapping[str, torch.Tensor],
    name: str,
    start: int,
    stop: int,
    dim: int | None = None,
    index: int = 0,
    parts: int = 1,
) -> torch.Tensor:
    """Elements ``start`` to ``stop`` (flattened) of part ``index`` of ``parts`` equal ones along ``dim`` (the whole
    tensor: None) of tensor ``name`` of ``weights``: read alone where ``weights`` reads flat ranges
    (``checkpoint.LazyWeights.flat``), else cut from the whole tensor."""
    read = getattr(weights, "flat", None)
    if read is not None:
        return read(name, start, stop, dim, index, parts)
    whole = weights[name]
    if dim is not None:
        size = whole.shape[dim] // parts
        whole = whole.narrow(dim, index * size, size)
    return whole.reshape(-1)[start:stop]


def load_into_partitioned(model: nn.Module, weights: Mapping[str, torch.Tensor]) -> None:
    """``weights`` (names of the model's state to tensors, perhaps read on lookup) into ``model``, one tensor at a
    time, each rank reading its partitions of ZeRO-3's parameters alone (:func:`load_own_partition`); tensors on the
    meta device are left as they are; a missing or an extra name is an error."""
    load_state(model, weights, _load_tensor)


def _load_tensor(tensor: torch.Tensor, weights: Mapping[str, torch.Tensor], name: str) -> None:
    if is_zero3_param(tensor):
        load_own_partition(tensor, weights, name)
    else:
        tensor.copy_(weights[name])


def partitioned_for_inference(
    cfg: RunConfig, weights: Mapping[str, torch.Tensor], world_size: int, dtype: torch.dtype = torch.float32
) -> nn.Module:
    """``cfg``'s model in ``dtype`` (fp32 or bf16), partitioned over the ``world_size`` ranks as it is made, with
    ``weights`` loaded (each rank reading its partitions alone), under DeepSpeed's ZeRO-3 without an optimizer: a
    module in evaluation mode whose every forward gathers each layer's parameters from all ranks, which run their
    forwards together."""
    import deepspeed

    from megatransformer.planner import zero3_sizes

    zero = {"stage": 3, "memory_efficient_linear": False, **zero3_sizes(cfg.model, 1, world_size).deepspeed()}
    config = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": world_size, "zero_optimization": zero}
    config["bf16"] = {"enabled": dtype == torch.bfloat16}  # (the dtype is the config's, as in build_for_run)
    with zero3_init_unwritten(config_dict_or_path=config):
        model = construct(cfg.model)
    remake_buffers(model)
    load_into_partitioned(model, weights)
    engine, *_ = deepspeed.initialize(model=model, config=config)
    return engine.module.eval()


# ------------------------------------------------------------------------------------ tensor parallelism


@contextmanager
def linear_weights_on_meta() -> Iterator[None]:
    """Linear layers made in it get parameters of their own on the meta device (where a linear layer is given one
    made before, as a tied output head is, it keeps it). Their values are :func:`init_weights`' anyway."""
    seen: dict[int, nn.Parameter] = {}  # (held, so that no id is reused while it runs)

    def registered(module: nn.Module, name: str, param: nn.Parameter | None) -> nn.Parameter | None:
        if param is None or id(param) in seen:
            return None
        if isinstance(module, nn.Linear) and not param.is_meta:
            param = nn.Parameter(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
            seen[id(param)] = param
            return param
        seen[id(param)] = param
        return None

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(registered)
    try:
        yield
    finally:
        handle.remove()


def replace_parameter(module: nn.Module, name: str, value: torch.Tensor, groups: list | None = None) -> nn.Parameter:
    """Set a new parameter of ``value`` as ``module``'s ``name`` in place of its parameter, with the attributes set
    on that (AutoTP's marks), and in its place in ``groups`` (parameter groups, or parameters, as
    ``deepspeed.initialize`` takes them); returns it. (A meta parameter cannot be given a real tensor as its
    ``.data``, and ``torch.utils.swap_tensors`` refuses a parameter DeepSpeed's engine holds a weak reference to.)"""
    old = getattr(module, name)
    new = nn.Parameter(value, requires_grad=old.requires_grad)
    new.__dict__.update(old.__dict__)
    setattr(module, name, new)
    groups = groups or []
    for params in [g["params"] for g in groups] if groups and isinstance(groups[0], dict) else [groups]:
        for i, param in enumerate(params):
            if param is old:
                params[i] = new
    return new


@contextmanager
def slices_made_by_autotp(
    model: nn.Module,
    cfg: RunConfig,
    device: torch.device | str,
    weights: Mapping[str, torch.Tensor] | None = None,
    groups: list | None = None,
) -> Iterator[None]:
    """Around ``deepspeed.initialize`` of a model :func:`build_for_run` built with tensor parallelism: as AutoTP
    sets each of its layers in place, with the parameters sliced on the meta device, this rank's slices are made on
    ``device`` as new parameters (in their places in ``groups``, the parameter groups or parameters given to
    ``deepspeed.initialize`` as a list): in fp32, or where the model's other parameters are partitioned (ZeRO-3) in
    their dtype and partitioned as they are, each as soon as it is made, each rank then writing its own partition.
    Their values: the slices of the one-rank build's (drawn a block of rows at a time, from the blocks that hold
    the slice, or the partition, alone), or of ``weights`` (init_from: names of the model's state to tensors; only
    the slices are read where ``weights`` reads flat ranges, :func:`read_flat`), whose other tensors are loaded
    first (each rank reading its partitions of the partitioned ones alone). A parameter still on the meta device
    after it is an error."""
    rules = {id(param): (name, std) for name, param, std in initial_values(model, cfg.model) if param.is_meta}
    shapes = {id(param): param.shape for param in model.parameters() if param.is_meta}
    if any(id(param) not in rules for param in model.parameters() if param.is_meta):
        raise RuntimeError("a parameter on the meta device has no initial value (transformer.initial_values)")
    if weights is not None:
        load_into_partitioned(model, weights)
    partitioned = next((param for param in model.parameters() if is_zero3_param(param)), None)
    dtype = torch.float32 if partitioned is None else partitioned.dtype
    tp = cfg.parallel.tensor_parallel

    def installed(parent: nn.Module, child_name: str, module: nn.Module | None) -> None:
        if module is None or not is_autotp_layer(module):
            return
        from deepspeed.utils import groups as deepspeed_groups

        rank = deepspeed_groups.get_tensor_model_parallel_rank()
        for attribute, param in list(module.named_parameters(recurse=False)):
            if param.is_meta and id(param) in rules:
                name, std = rules.pop(id(param))
                made = torch.empty(param.shape, dtype=dtype, device=device)
                made = replace_parameter(module, attribute, made, groups)
                whole = shapes[id(param)]
                if partitioned is None:
                    _write_slice(made, name, std, whole, param.shape, rank, tp, cfg.seed, weights)
                else:  # (partitioned unwritten; then each rank writes its own partition of the slice)
                    partitioner_of(partitioned)([made])
                    partition, start = zero3_partition(made)
                    _write_slice(partition, name, std, whole, param.shape, rank, tp, cfg.seed, weights, start)

    handle = torch.nn.modules.module.register_module_module_registration_hook(installed)
    try:
        yield
    finally:
        handle.remove()
    left = [name for name, param in model.named_parameters() if param.is_meta]
    if left:
        raise RuntimeError(f"AutoTP left parameters on the meta device, not sliced: {left[:3]}")


@torch.no_grad()
def _write_slice(
    target: torch.Tensor,
    name: str,
    std: float | None,
    whole: torch.Size,
    shape: torch.Size,
    rank: int,
    tp: int,
    seed: int,
    weights: Mapping[str, torch.Tensor] | None,
    start: int = 0,
) -> None:
    """Elements ``start`` to ``start + target.numel()`` (flattened; those past its end left as they are) of
    tensor-parallel rank ``rank``'s slice, of ``shape``, of parameter ``name`` (of shape ``whole``) into contiguous
    ``target``: AutoTP's split, ``tp`` equal parts along the one dimension where ``shape`` differs (whole where none
    does)."""
    dims = [d for d, (n, m) in enumerate(zip(whole, shape, strict=True)) if n != m]
    if len(dims) > 1 or (dims and shape[dims[0]] * tp != whole[dims[0]]):
        raise RuntimeError(f"AutoTP sliced {name} {tuple(whole)} to {tuple(shape)}, not into {tp} equal parts")
    if weights is not None:
        stop = min(start + target.numel(), math.prod(shape))
        if stop > start:
            values = read_flat(weights, name, start, stop, dims[0] if dims else None, rank, tp)
            target.view(-1)[: stop - start].copy_(values)
    elif dims:
        draw_part_into(target, seed, name, std, whole, dims[0], rank, tp, start)
    else:
        draw_part_into(target, seed, name, std, whole, start=start)
