"""bf16 matrix products on CPUs without bf16 GEMM kernels: computed as fp32 GEMMs of the bf16 operands.

PyTorch runs bf16 GEMMs on a CPU with oneDNN where the CPU has AVX-512 (BW/VL/DQ; AVX512_BF16 and AMX natively),
AVX-NE-CONVERT (recent Intel client CPUs) or Arm's BF16 extension. Elsewhere (AVX2-only x86: Zen 2/3, Intel client CPUs)
``mm`` and ``bmm`` fall back to a generic loop. On a 2-core AVX2 EPYC with torch 2.13 the bf16 GEMMs of a training step
ran 7-186x slower (by the operands' layout) than fp32 GEMMs of the same operands (``bench/cpu_bf16.py``), and the
trainer ran a bf16 step of the benchmark model 25x faster with this module (BENCHMARKS.md, section 5g).

The product of two bf16 numbers is exact in fp32 (8-bit significands, a 16-bit product), so a bf16 GEMM
with fp32 accumulation (what oneDNN and cuBLAS compute) is the fp32 GEMM of the upcast operands, up to the
order of the sums, rounded once to bf16. :class:`Fp32Gemms` is a ``TorchDispatchMode`` that does exactly
that for the GEMM operators on CPU bf16 tensors. It works below autograd, so the tensors autograd saves for
the backward pass stay bf16 (memory is that of a bf16 run), the backward pass's GEMMs are covered too, and
the model code knows nothing of it.

PyTorch's fused CPU attention (SDPA's flash kernel, ``attention_backend=sdpa`` without dropout, and what
transformers models run) does its products with the same slow bf16 GEMMs (a forward and backward 5x its fp32
form's time here); it runs in fp32 too, its outputs rounded once to bf16. That form keeps the softmax's
probabilities in fp32 for their product with the values where the bf16 kernel rounds them to bf16 first: more
precise, not bit-identical. Every other operator passes through untouched. Muon's bf16 Newton-Schulz iterations
run in it too (training/optimizers/muon.py).
"""

from __future__ import annotations

import contextlib
import functools
import typing

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatransformer.config import TrainConfig

CHOICES = typing.get_args(TrainConfig.model_fields["cpu_bf16_matmul"].annotation)  # ("auto", "fp32", "native")

_aten = torch.ops.aten
# the GEMM operators that linear, matmul, einsum and our attention cores and head lower to
GEMMS = frozenset(
    getattr(packet, overload)
    for packet in (_aten.mm, _aten.bmm, _aten.addmm, _aten.baddbmm)
    for overload in ("default", "out")
)
GEMMS_IN_PLACE = {_aten.addmm_.default: _aten.addmm.default, _aten.baddbmm_.default: _aten.baddbmm.default}
# fused attention -> which of its outputs are in the inputs' dtype (the forward's log-sum-exp is fp32 in any case)
ATTENTION = {
    _aten._scaled_dot_product_flash_attention_for_cpu.default: (0,),
    _aten._scaled_dot_product_flash_attention_for_cpu_backward.default: (0, 1, 2),
}


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether PyTorch runs bf16 GEMMs on this CPU with oneDNN, rather than its generic fallback loop."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # (PyTorch's own test, 1.13+)
    if check is not None:
        return bool(check())
    return torch.backends.cpu.get_cpu_capability() != "AVX2"  # unknown: keep PyTorch's kernels


def _upcast(args, kwargs) -> tuple[list, dict]:
    """``args`` and ``kwargs`` with each bf16 tensor upcast once however often it is passed (``addmm(A, A, A)``:
    one copy)."""
    copies: dict[int, torch.Tensor] = {}

    def upcast(value):
        if not (isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16):
            return value
        if id(value) not in copies:
            copies[id(value)] = value.float()
        return copies[id(value)]

    return [upcast(a) for a in args], {k: upcast(v) for k, v in kwargs.items()}


def _is_cpu_bf16(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16 and value.device.type == "cpu"


class Fp32Gemms(TorchDispatchMode):
    """Runs the GEMMs (and fused CPU attention) of CPU bf16 tensors in fp32 on the upcast operands, rounded once
    to bf16."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ATTENTION and any(_is_cpu_bf16(a) for a in args):
            args, kwargs = _upcast(args, kwargs)
            outputs = func(*args, **kwargs)
            return tuple(o.to(torch.bfloat16) if i in ATTENTION[func] else o for i, o in enumerate(outputs))
        in_place = GEMMS_IN_PLACE.get(func)
        if (func in GEMMS or in_place is not None) and any(_is_cpu_bf16(a) for a in args):
            out = args[0] if in_place is not None else kwargs.pop("out", None)
            compute = in_place or func.overloadpacket.default
            args, kwargs = _upcast(args, kwargs)
            result = compute(*args, **kwargs)
            if out is None:
                return result.to(torch.bfloat16)
            return out.copy_(result)
        return func(*args, **kwargs)


def gemms_as_fp32(choice: str, device: torch.device | str, dtype: torch.dtype, compiled: bool = False) -> bool:
    """Whether a run's bf16 GEMMs go through :class:`Fp32Gemms` (``train.cpu_bf16_matmul``)."""
    if choice not in CHOICES:
        raise ValueError(f"cpu_bf16_matmul {choice!r}: choose from {CHOICES}")
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16 or compiled or choice == "native":
        return False  # (a compiled model's GEMMs are the compiler's choice)
    return choice == "fp32" or not native_bf16_gemm()


def matmul_context(enabled: bool) -> typing.Callable[[], contextlib.AbstractContextManager]:
    """A factory of the context each forward and backward pass of a run runs in."""
    return Fp32Gemms if enabled else contextlib.nullcontext


def describe(
    choice: str, device: torch.device | str, dtype: torch.dtype, compiled: bool = False, what: str = "bf16 matmuls"
) -> str | None:
    """The run log's line on how bf16 GEMMs run on a CPU (None on GPUs and in other precisions); ``what``: whose
    (the model's, or Muon's Newton-Schulz)."""
    if torch.device(device).type != "cpu" or dtype != torch.bfloat16:
        return None
    if gemms_as_fp32(choice, device, dtype, compiled):
        why = "" if choice == "fp32" else " (this CPU has no bf16 GEMM kernels in PyTorch)"
        return f"{what}: fp32 GEMMs of the bf16 operands{why}; train.cpu_bf16_matmul={choice}"
    if compiled and choice != "native":
        return f"{what}: the compiled model's own (train.compile=true)"
    slow = "" if native_bf16_gemm() else ", which on this CPU are a generic loop many times slower than fp32"
    return f"{what}: PyTorch's bf16 kernels{slow}; train.cpu_bf16_matmul={choice}"
