"""bf16 GEMMs on this CPU: PyTorch's own kernels against fp32 GEMMs of the bf16 operands (``Fp32Gemms``), and fp32.

The shapes are those of a training step of the end-to-end benchmark model (d512, FFN 1408, 8 heads of 64 over 4
key/value heads, 4 x 512 tokens, the chunked attention core's 64-query chunks): a projection, its two backward
GEMMs, the attention core's score and value products, and SDPA's fused CPU attention (forward and backward). Each case
alternates the three ways in one process; the figure is the median of ``--repeats`` timings.

    python bench/cpu_bf16.py
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatransformer.training.runtime.cpu_bf16 import Fp32Gemms, native_bf16_gemm  # noqa: E402

TOKENS, D_MODEL, FFN, CHUNK, KEYS, HEAD_DIM, GROUPS = 2048, 512, 1408, 64, 512, 64, 2
CASES = {  # name -> (operand shapes, the product)
    "linear d512 -> 1408 (forward)": (
        ((TOKENS, D_MODEL), (FFN, D_MODEL)),
        lambda x, w: torch.nn.functional.linear(x, w),
    ),
    "grad input 1408 -> d512": (((TOKENS, FFN), (FFN, D_MODEL)), lambda g, w: g @ w),
    "grad weight [1408, 512]": (((TOKENS, FFN), (TOKENS, D_MODEL)), lambda g, x: g.t() @ x),
    "attention scores (bmm)": (
        ((4 * 4, CHUNK * GROUPS, HEAD_DIM), (4 * 4, KEYS, HEAD_DIM)),
        lambda q, k: torch.bmm(q, k.transpose(1, 2)),
    ),
    "attention values (bmm)": (((4 * 4, CHUNK * GROUPS, KEYS), (4 * 4, KEYS, HEAD_DIM)), torch.bmm),
    "SDPA's fused CPU attention, forward + backward": (
        ((4, 8, KEYS, HEAD_DIM),) * 3,
        lambda q, k, v: attention_step(q, k, v),
    ),
}
WAYS = ("bf16 native", "bf16 as fp32 GEMMs", "fp32")


def attention_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Causal attention and its gradients, as in a training step."""
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.autograd.grad(out, (q, k, v), torch.ones_like(out))


def timed(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(
        f"# {datetime.date.today()} {platform.machine()}, {torch.get_num_threads()} threads, "
        f"torch {torch.__version__}, "
        f"CPU capability {torch.backends.cpu.get_cpu_capability()}, PyTorch bf16 GEMM kernels: {native_bf16_gemm()}"
    )
    print("| GEMM | " + " | ".join(f"{w}, ms" for w in WAYS) + " | native / as fp32 GEMMs |")
    print("|---|" + "---|" * (len(WAYS) + 1))
    g = torch.Generator().manual_seed(0)
    for name, (shapes, product) in CASES.items():
        fp32 = [torch.randn(*s, generator=g) for s in shapes]
        bf16 = [t.bfloat16() for t in fp32]
        ms = {}
        for way, operands, mode in zip(
            WAYS, (bf16, bf16, fp32), (contextlib.nullcontext, Fp32Gemms, contextlib.nullcontext)
        ):

            def run(operands=operands, mode=mode, product=product):
                with mode():
                    product(*operands)

            ms[way] = timed(run, args.repeats) * 1e3
        cells = " | ".join(f"{ms[w]:.1f}" for w in WAYS)
        print(f"| {name} | {cells} | {ms['bf16 native'] / ms['bf16 as fp32 GEMMs']:.1f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
