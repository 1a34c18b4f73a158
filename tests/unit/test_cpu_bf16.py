"""bf16 GEMMs as fp32 GEMMs of the bf16 operands on CPUs without bf16 kernels (training/runtime/cpu_bf16.py)."""

from __future__ import annotations

import collections
import contextlib
import platform
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatransformer.config import ModelConfig
from megatransformer.model import build_model
from megatransformer.training.runtime import cpu_bf16
from megatransformer.training.runtime.cpu_bf16 import Fp32Gemms, describe, gemms_as_fp32

BF16 = torch.bfloat16


class Ops(TorchDispatchMode):
    """Records (operator, dtypes of its tensor arguments) of every call that reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        dtypes = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
        self.calls[(func.overloadpacket.__name__, dtypes)] += 1
        return func(*args, **(kwargs or {}))

    def gemms(self, dtype: torch.dtype) -> int:
        return sum(
            n
            for (name, dtypes), n in self.calls.items()
            if name in ("mm", "bmm", "addmm", "baddbmm", "addmm_", "baddbmm_") and dtype in dtypes
        )


def rand(*shape: int, dtype=BF16, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape) + seed)).to(dtype)


GEMM_CASES = {
    "mm": lambda a, b, bias, a3, b3, bias3: torch.mm(a, b),
    "bmm": lambda a, b, bias, a3, b3, bias3: torch.bmm(a3, b3),
    "addmm": lambda a, b, bias, a3, b3, bias3: torch.addmm(bias, a, b, beta=0.5, alpha=2.0),
    "baddbmm": lambda a, b, bias, a3, b3, bias3: torch.baddbmm(bias3, a3, b3, alpha=-1.0),
    "linear": lambda a, b, bias, a3, b3, bias3: torch.nn.functional.linear(a, b.t(), bias[0]),
    "matmul": lambda a, b, bias, a3, b3, bias3: a3 @ b3,
}


@pytest.mark.parametrize("case", sorted(GEMM_CASES))
def test_bf16_gemms_are_the_rounded_fp32_gemms_of_their_operands(case):
    shapes = [(48, 40), (40, 56), (48, 56), (3, 48, 40), (3, 40, 56), (3, 48, 56)]
    operands = [rand(*s) for s in shapes]
    expected = GEMM_CASES[case](*(x.float() for x in operands)).to(BF16)
    below = Ops()
    with below, Fp32Gemms():  # (what the mode issues reaches the mode entered before it)
        got = GEMM_CASES[case](*operands)
    assert got.dtype == BF16 and torch.equal(got, expected)
    assert below.gemms(BF16) == 0 and below.gemms(torch.float32) == 1  # no bf16 GEMM kernel ran


def test_out_and_in_place_variants_write_their_destination():
    a, b = rand(16, 24), rand(24, 8)
    expected = (a.float() @ b.float()).to(BF16)
    out = torch.empty(16, 8, dtype=BF16)
    acc = rand(16, 8)
    acc_expected = (acc.float() + a.float() @ b.float()).to(BF16)
    with Fp32Gemms():
        returned = torch.mm(a, b, out=out)
        acc.addmm_(a, b)
    assert returned is out and torch.equal(out, expected)
    assert torch.equal(acc, acc_expected)


def test_other_operators_and_other_dtypes_pass_through_untouched():
    a32, b32 = rand(16, 24, dtype=torch.float32), rand(24, 8, dtype=torch.float32)
    a, b = a32.to(BF16), b32.to(BF16)
    below = Ops()
    with below, Fp32Gemms():
        product = a32 @ b32
        summed, activated = a + a, torch.nn.functional.silu(b)
    assert torch.equal(product, a32 @ b32) and torch.equal(summed, a + a)
    assert torch.equal(activated, torch.nn.functional.silu(b))
    assert below.calls[("mm", (torch.float32, torch.float32))] == 1  # the fp32 GEMM itself, once
    assert not any(name == "_to_copy" for name, _ in below.calls)  # nothing converted


def test_autograd_keeps_bf16_tensors_and_its_backward_gemms_are_fp32():
    """The mode works below autograd: saved activations stay bf16 (a bf16 run's memory), and the backward
    pass's GEMMs are covered too."""
    layer = torch.nn.Linear(32, 48).to(BF16)
    x = rand(4, 16, 32).requires_grad_()
    saved: list[torch.dtype] = []
    below = Ops()
    record_dtypes = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t)
    with record_dtypes, below, Fp32Gemms():
        out = torch.bmm(layer(x), rand(4, 48, 8))
        out.square().sum().backward()
    assert saved and set(saved) == {BF16}
    assert below.gemms(BF16) == 0 and below.gemms(torch.float32) >= 5  # 2 forward, 3+ backward
    reference = torch.nn.Linear(32, 48).double()
    reference.load_state_dict(layer.state_dict())
    x64 = x.detach().double().requires_grad_()
    torch.bmm(reference(x64), rand(4, 48, 8).double()).square().sum().backward()
    for got, want in ((x.grad, x64.grad), (layer.weight.grad, reference.weight.grad)):
        assert got.dtype == BF16
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max().item())


def test_fused_cpu_attention_runs_in_fp32_and_is_at_least_as_close_to_float64():
    """SDPA's CPU flash kernel (attention_backend=sdpa, transformers models): fp32 in, outputs rounded once;
    its bf16 form rounds the probabilities to bf16 before their product with the values, this one does not."""
    q, k, v = (rand(2, 4, 96, 32, seed=i).requires_grad_() for i in range(3))

    def attend(*qkv):
        return torch.nn.functional.scaled_dot_product_attention(*qkv, is_causal=True)

    results = []
    for mode in (Fp32Gemms, contextlib.nullcontext):
        below = Ops()
        with below, mode():
            out = attend(q, k, v)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
        results.append((out, grads, below))
    (out, grads, below), (native_out, native_grads, _) = results
    fused = [(name, dtypes) for name, dtypes in below.calls if "attention" in name]
    assert fused and all(BF16 not in dtypes for _, dtypes in fused)  # the bf16 kernel never ran
    assert torch.equal(out, attend(*(x.detach().float() for x in (q, k, v))).to(BF16))
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    out64 = attend(q64, k64, v64)
    grads64 = torch.autograd.grad(out64.square().sum(), (q64, k64, v64))
    for got, native, want in zip((out, *grads), (native_out, *native_grads), (out64, *grads64)):
        assert got.dtype == BF16
        error, native_error = ((x.double() - want).abs().max() / want.abs().max() for x in (got, native))
        assert error <= native_error * 1.01 and error < 2e-2


@pytest.mark.parametrize("arch", ["decoder", "encoder_decoder"])
def test_a_bf16_model_step_equals_the_native_bf16_step_to_bf16_rounding(arch):
    """Loss and every gradient of our model (chunked attention core, fused loss head) under the mode against
    PyTorch's own bf16 kernels: the same products summed in another order."""
    cfg = ModelConfig(
        arch=arch,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=128,
        vocab_size=256,
        max_seq_len=64,
        norm="rmsnorm",
        position="rope",
        ffn="swiglu",
        attention_backend="chunked",
    )
    torch.manual_seed(0)
    model = build_model(cfg).to(BF16)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    inputs = {"input_ids": ids, "labels": ids.roll(-1, 1)}
    if arch == "encoder_decoder":
        inputs["decoder_input_ids"] = ids.flip(1)
    results = []
    for mode in (Fp32Gemms, None):
        model.zero_grad()
        below = Ops()
        with below, mode() if mode else contextlib.nullcontext():
            loss = model(**inputs)
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters()], below.gemms(BF16)))
    (loss, grads, bf16_gemms), (native_loss, native_grads, native_gemms) = results
    assert bf16_gemms == 0 and native_gemms > 20
    torch.testing.assert_close(loss, native_loss, rtol=1e-2, atol=0)
    for got, want in zip(grads, native_grads):
        assert got.dtype == BF16
        torch.testing.assert_close(got.float(), want.float(), rtol=5e-2, atol=5e-2 * want.float().abs().max().item())


@pytest.mark.parametrize(
    "choice,device,dtype,compiled,native,expected",
    [
        ("auto", "cpu", BF16, False, False, True),  # an AVX2-only CPU
        ("auto", "cpu", BF16, False, True, False),  # oneDNN's bf16 kernels
        ("fp32", "cpu", BF16, False, True, True),
        ("native", "cpu", BF16, False, False, False),
        ("auto", "cpu", torch.float32, False, False, False),
        ("fp32", "cuda", BF16, False, False, False),
        ("auto", "cpu", BF16, True, False, False),  # a compiled model's GEMMs are the compiler's
    ],
)
def test_which_runs_use_fp32_gemms(monkeypatch, choice, device, dtype, compiled, native, expected):
    monkeypatch.setattr(cpu_bf16, "native_bf16_gemm", lambda: native)
    assert gemms_as_fp32(choice, device, dtype, compiled) is expected


def test_the_run_log_says_how_bf16_gemms_run(monkeypatch):
    monkeypatch.setattr(cpu_bf16, "native_bf16_gemm", lambda: False)
    assert describe("auto", "cpu", BF16) == (
        "bf16 matmuls: fp32 GEMMs of the bf16 operands (this CPU has no bf16 "
        "GEMM kernels in PyTorch); train.cpu_bf16_matmul=auto"
    )
    assert "many times slower than fp32" in describe("native", "cpu", BF16)
    assert describe("auto", "cpu", BF16, compiled=True) == "bf16 matmuls: the compiled model's own (train.compile=true)"
    assert describe("auto", "cpu", torch.float32) is None and describe("auto", "cuda", BF16) is None
    monkeypatch.setattr(cpu_bf16, "native_bf16_gemm", lambda: True)
    assert describe("auto", "cpu", BF16) == "bf16 matmuls: PyTorch's bf16 kernels; train.cpu_bf16_matmul=auto"


@pytest.mark.skipif(
    platform.machine() != "x86_64" or not Path("/proc/cpuinfo").is_file(),
    reason="reads the x86 CPU flags from /proc/cpuinfo (Linux); other machines use PyTorch's test alone",
)
def test_bf16_gemm_kernels_are_found_where_the_cpu_has_avx512_and_not_on_plain_avx2():
    """oneDNN's bf16 GEMMs need AVX-512 BW, VL and DQ (AVX512_BF16 / AMX run them natively), or, on recent
    AVX2-only Intel CPUs, AVX-NE-CONVERT."""
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    if all(f in flags for f in ("avx512bw", "avx512vl", "avx512dq")):
        assert cpu_bf16.native_bf16_gemm()
    elif not any(f.startswith(("avx512", "avx_ne_convert", "amx")) for f in flags):
        assert not cpu_bf16.native_bf16_gemm()
    else:
        pytest.skip(f"a partial AVX-512 or AVX-NE-CONVERT CPU: oneDNN decides ({cpu_bf16.native_bf16_gemm()} here)")


def test_an_unknown_choice_is_refused():  # (in a config: tests/unit/test_config_values.py)
    with pytest.raises(ValueError, match="choose from"):
        gemms_as_fp32("fast", "cpu", BF16)
