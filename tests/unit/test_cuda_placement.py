"""Device placement of a training step's GPU code, checked on a CPU: the batch's copy to the device, the masks'
metadata and the model's forward with the loss run on fake CUDA tensors (``FakeTensorMode``: shapes, dtypes
and devices propagate, no kernel runs), where a CPU tensor mixed into an operation raises
``FakeTensorDeviceMismatchError`` as it would on a GPU.

A CPU-only PyTorch cannot build an autograd graph over CUDA tensors (its engine needs the device's guard), so
the backward pass runs on the ``meta`` device, which refuses CPU operands in the same elementwise operations.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.attention.varlen
from support.attention import alibi_config, packed_batch
from support.flash_registry import register_fake, restore_torch_impls
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.overrides import TorchFunctionMode

from megatransformer.batch import IGNORE_INDEX
from megatransformer.model import attention, build_model, gpu_cores, masks
from megatransformer.training.engine import train_module as engine

CUDA = torch.device("cuda")


class FakeFlashAttn:
    """flash-attn's two functions as shape and device checks: every tensor argument on q's device."""

    @staticmethod
    def _check(q, *tensors):
        assert all(t.device == q.device for t in tensors if isinstance(t, torch.Tensor)), "a tensor off q's device"
        return torch.empty_like(q)

    @classmethod
    def flash_attn_func(cls, q, k, v, dropout_p=0.0, causal=False, alibi_slopes=None):
        return cls._check(q, k, v, alibi_slopes)

    @classmethod
    def flash_attn_varlen_func(cls, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=False, alibi_slopes=None):
        assert type(max_q) is int and type(max_k) is int
        return cls._check(q, k, v, cu_q, cu_k, alibi_slopes)


class GuardFreeOperators(TorchFunctionMode):
    """The few calls whose C++ code takes a device guard, which a CPU-only PyTorch has none of for CUDA, as the
    equivalent operators, which dispatch to the fake tensors like any other: Python indexing (``x[..., 1:]``),
    ``~x`` and ``masked_fill``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.__getitem__:
            return index(*args)
        if func is torch.Tensor.__invert__:
            return torch.bitwise_not(*args)
        if func is torch.Tensor.masked_fill:
            x, mask, value = args
            return torch.where(torch.logical_not(mask), x, value)
        return func(*args, **(kwargs or {}))


def index(x: torch.Tensor, key) -> torch.Tensor:
    """``x[key]`` for keys of ints, slices, ``...``, ``None`` and index tensors, by operators."""
    key = list(key) if isinstance(key, tuple) else [key]
    if Ellipsis in key:
        at = key.index(Ellipsis)
        fill = x.dim() - sum(k is not None for k in key if k is not Ellipsis)
        key[at : at + 1] = [slice(None)] * fill
    dim, tensors = 0, []
    for k in key:
        if k is None:
            x = x.unsqueeze(dim)
            tensors.append(None)
            dim += 1
        elif isinstance(k, int):
            x = x.select(dim, k)
        elif isinstance(k, slice):
            start, stop, step = k.indices(x.shape[dim])
            x = torch.ops.aten.slice.Tensor(x, dim, start, stop, step)
            tensors.append(None)
            dim += 1
        else:  # a tensor: advanced indexing
            tensors.append(k)
            dim += 1
    if any(t is not None for t in tensors):
        x = torch.ops.aten.index.Tensor(x, tensors)
    return x


def training_batch(arch: str) -> dict[str, torch.Tensor]:
    batch = packed_batch(arch)
    targets = batch.get("decoder_input_ids", batch["input_ids"])
    batch["labels"] = targets.roll(-1, 1).masked_fill(targets == 0, IGNORE_INDEX)
    return batch


def to_fake(device: torch.device, mode: FakeTensorMode | None):
    """A stand-in for ``masks.to_device`` (which pins host memory, a CUDA-only allocator) producing fake
    tensors on ``device`` (``mode``), or meta tensors."""

    def convert(tensor, target=None, moved=None):
        if tensor is None or tensor.device == device:
            return tensor
        if moved is not None and id(tensor) in moved:
            return moved[id(tensor)]
        on_meta = tensor.to("meta")
        return on_meta if mode is None else FakeTensor(mode, on_meta, device)

    return convert


def same_device_varlen_attn(monkeypatch):
    """PyTorch's ``varlen_attn`` (its fake kernel checks shapes only) also checking its tensors' devices."""
    varlen_attn = torch.nn.attention.varlen.varlen_attn

    def checked(query, key, value, cu_seq_q, cu_seq_k, *args, **kwargs):
        assert {t.device for t in (key, value, cu_seq_q, cu_seq_k)} == {query.device}, "a tensor off q's device"
        return varlen_attn(query, key, value, cu_seq_q, cu_seq_k, *args, **kwargs)

    monkeypatch.setattr(torch.nn.attention.varlen, "varlen_attn", checked)


@pytest.fixture
def core(request, monkeypatch):
    """The attention core ``auto`` takes on a GPU: flash-attn, flash-attn 4 through PyTorch's registry (a fake
    registered on a Blackwell: SDPA's flash backend and varlen_attn), or PyTorch's varlen_attn and SDPA."""
    name = request.param
    monkeypatch.setattr(attention, "flash_attn_module", lambda: FakeFlashAttn if name == "flash" else None)
    monkeypatch.setattr(attention, "flash_attn_installed", lambda: name == "flash")
    monkeypatch.setattr(attention, "torch_varlen_available", lambda: name == "varlen")
    same_device_varlen_attn(monkeypatch)
    if name == "fa4":
        monkeypatch.setattr(gpu_cores, "gpu_generation", lambda: "blackwell")
        monkeypatch.setattr(gpu_cores, "registry_skip", lambda core, generation: None)  # (as once measured)
        register_fake(monkeypatch, "FA4", [])
    yield name
    if name == "fa4":
        restore_torch_impls()


def step_on(device: torch.device, arch: str, position: str, mode: FakeTensorMode | None, monkeypatch):
    """The engine's batch copy (host masks with varlen metadata) and the model's loss, on ``device``; the
    model converted as ``module.to(device)`` converts it, in bf16 as DeepSpeed runs it."""
    convert = to_fake(device, mode)
    monkeypatch.setattr(engine, "to_device", convert)
    monkeypatch.setattr(masks, "to_device", convert)
    torch.manual_seed(0)
    fields = LATENT if position == "mla" else {"position": position}
    model = build_model(alibi_config(arch, attention_backend="auto", **fields))
    move_module(model, lambda t: convert(t.to(torch.bfloat16) if t.is_floating_point() else t), mode is None)
    inputs, labels, step_masks = engine.batch_to_device(training_batch(arch), device, arch, varlen=True)
    with mode or nullcontext(), GuardFreeOperators():  # (the host's work above runs on real tensors)
        return model, model(**inputs, masks=step_masks, labels=labels)


def move_module(model: torch.nn.Module, convert, requires_grad: bool) -> None:
    """Every parameter and buffer converted (a tied weight once), as ``Module.to`` does (which cannot swap a
    parameter for a fake tensor)."""
    converted = {}
    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None and id(tensor) not in converted:
                    new = convert(tensor.detach())
                    is_parameter = isinstance(tensor, torch.nn.Parameter)
                    converted[id(tensor)] = torch.nn.Parameter(new, requires_grad) if is_parameter else new
                if tensor is not None:
                    store[name] = converted[id(tensor)]


# position "mla": RoPE in multi-head latent attention, values narrower than queries and keys
LATENT = dict(position="rope", attention="mla", n_kv_heads=None, kv_lora_rank=16, qk_rope_head_dim=4, v_head_dim=6)
ARCHS = [
    ("decoder", "rope"),
    ("decoder", "alibi"),
    ("encoder", "rope"),
    ("encoder_decoder", "alibi"),
    ("decoder", "mla"),
]


@pytest.mark.parametrize("core", ["flash", "fa4", "varlen", "sdpa"], indirect=True)
@pytest.mark.parametrize("arch, position", ARCHS)
def test_the_forward_with_its_loss_stays_on_cuda(core, arch, position, monkeypatch):
    calls = []
    if core == "fa4":
        fa4 = attention.BACKENDS["fa4"]
        monkeypatch.setitem(attention.BACKENDS, "fa4", lambda *args: calls.append(1) or fa4(*args))
    with torch.no_grad():
        _, loss = step_on(CUDA, arch, position, FakeTensorMode(), monkeypatch)
    assert loss.device.type == "cuda" and loss.shape == ()
    if core == "fa4" and position != "alibi":  # (flash-attn 4 has no ALiBi: auto runs SDPA for those calls)
        assert calls


BACKWARD = [
    (arch, position, name)
    for arch, position in ARCHS
    for name in ("varlen", "sdpa")
    if (position, name) != ("alibi", "varlen")
]


@pytest.mark.parametrize("arch, position, name", BACKWARD)
def test_the_backward_stays_on_the_device(arch, position, name, monkeypatch):
    """On meta, with the GPU's cores by name (``auto`` would choose the CPU's; varlen_attn has no ALiBi);
    flash-attn's backward is its kernel's own, and the gathers and scatters around it are the varlen core's."""
    same_device_varlen_attn(monkeypatch)
    monkeypatch.setitem(attention.BACKENDS, "auto", attention.BACKENDS[name])
    model, loss = step_on(torch.device("meta"), arch, position, None, monkeypatch)
    loss.backward()
    assert all(p.grad is not None and p.grad.device.type == "meta" for p in model.parameters())
