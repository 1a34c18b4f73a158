"""Attention cores side by side: time and memory per backend, mask and sequence length.

Backends are ``megatransformer.model.attention.BACKENDS`` called exactly as the model calls them:
sdpa (PyTorch SDPA; prefix-LM and packed masks go in as a dense bool mask), chunked (ours: query chunks
with recomputation), flex (FlexAttention, compiled; on CPU forward only: no backward there), flash
(flash-attn, CUDA only, not for prefix-LM), eager (matmul-softmax reference, materialises L x L scores).

Masks: causal; prefix-LM (bidirectional over the first quarter / half of each row, causal after);
packed (documents of 100-700 tokens packed into each row, causal within each, as the data loader makes them).

Memory is the peak of live tensor bytes during one call (forward + backward when the backend can train),
above the inputs: on CPU from the allocator events of ``torch.profiler(profile_memory=True)``, on CUDA from
``torch.cuda.max_memory_allocated``. The "x per 2x L" column is that peak divided by the one at half the
length: ~2 means linear growth, ~4 quadratic.

    python bench/attention.py                          # CPU default: bf16, lengths 512 1024 2048
    python bench/attention.py --lengths 512,1024,2048,4096,8192 --backends sdpa,chunked
    python bench/attention.py --device cuda --lengths 512,1024,2048,4096,8192   # on a GPU
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from megatransformer.model.attention import BACKENDS  # noqa: E402
from megatransformer.model.masks import AttentionMask, self_attention_mask  # noqa: E402

MASKS = ("causal", "prefix", "packed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backends", default="sdpa,chunked,flex,eager,flash")
    p.add_argument("--masks", default=",".join(MASKS))
    p.add_argument("--lengths", default="512,1024,2048", help="comma list (up to 8192 is worth a look)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=["bf16", "fp32", "fp16"], default="bf16")
    p.add_argument("--reps", type=int, default=3, help="timed calls per cell (median)")
    p.add_argument("--eager-max", type=int, default=4096, help="skip eager above this length (L x L scores)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: process CPU time, immune to other processes' load (use with --threads 1)",
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def make_mask(name: str, batch: int, length: int, device: str) -> AttentionMask:
    if name == "causal":
        return self_attention_mask(True)
    if name == "prefix":
        prefix = torch.tensor([length // 4, length // 2] * batch)[:batch]
        return self_attention_mask(True, prefix_len=prefix.to(device))
    gen = torch.Generator().manual_seed(length)
    rows = []
    for _ in range(batch):
        lengths, total = [], 0
        while total < length:
            lengths.append(min(int(torch.randint(100, 700, (), generator=gen)), length - total))
            total += lengths[-1]
        rows.append(torch.repeat_interleave(torch.arange(1, len(lengths) + 1), torch.tensor(lengths)))
    return self_attention_mask(True, torch.stack(rows).to(device))


def supports(backend: str, mask: str, device: str) -> str | None:
    """Why a cell is skipped, or None."""
    if backend == "flash":
        if device != "cuda":
            return "CUDA only"
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            return "flash-attn not installed"
        if mask == "prefix":
            return "no prefix-LM masks"
    return None


def trains(backend: str, device: str) -> bool:
    return not (backend == "flex" and device == "cpu")  # FlexAttention has no CPU backward


def peak_bytes(fn, device: str) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for _, nbytes in sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    ):
        live += nbytes
        peak = max(peak, live)
    return peak


def measure(backend: str, mask_name: str, length: int, args: argparse.Namespace) -> tuple[float, int, bool]:
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[args.dtype]
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, length)

    def tensor(heads: int) -> torch.Tensor:  # the model's layout: a transposed view of [B, T, heads, D]
        x = torch.randn(*shape, heads, args.head_dim, generator=gen).to(args.device, dtype).transpose(1, 2)
        return x.requires_grad_(trains(backend, args.device))

    q, k, v = tensor(args.heads), tensor(args.kv_heads), tensor(args.kv_heads)
    mask = make_mask(mask_name, args.batch, length, args.device)
    core, train = BACKENDS[backend], trains(backend, args.device)
    grad = torch.randn(q.shape, generator=gen).to(args.device, dtype)

    def call() -> None:
        if train:
            core(q, k, v, mask, 0.0).backward(grad)
            q.grad = k.grad = v.grad = None
        else:
            with torch.no_grad():
                core(q, k, v, mask, 0.0)

    call()  # warm-up (and FlexAttention's compile)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    now = time.perf_counter if args.clock == "wall" else time.process_time
    times = []
    for _ in range(args.reps):
        sync()
        start = now()
        call()
        sync()
        times.append(now() - start)
    return statistics.median(times), peak_bytes(call, args.device), train


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(x) for x in args.lengths.split(",")]
    print(
        f"# {datetime.date.today()} {platform.machine()} device={args.device} threads={torch.get_num_threads()}"
        f" torch={torch.__version__}; batch {args.batch}, heads {args.heads}/{args.kv_heads} kv,"
        f" head_dim {args.head_dim}, {args.dtype}, clock={args.clock}, median of {args.reps}"
    )
    print(f"# command: python {' '.join(sys.argv)}")
    print("| mask | backend | pass | " + " | ".join(f"L={n} ms / MiB" for n in lengths) + " | x per 2x L (memory) |")
    print("|---|---|---|" + "---|" * len(lengths) + "---|")
    for mask_name in args.masks.split(","):
        for backend in args.backends.split(","):
            skip = supports(backend, mask_name, args.device)
            if skip:
                print(f"| {mask_name} | {backend} | - | " + " | ".join("-" for _ in lengths) + f" | {skip} |")
                continue
            cells, peaks, passes = [], [], "fwd+bwd" if trains(backend, args.device) else "fwd"
            for n in lengths:
                if backend == "eager" and n > args.eager_max:
                    cells.append(f"skipped (> --eager-max {args.eager_max})")
                    continue
                seconds, peak, _ = measure(backend, mask_name, n, args)
                cells.append(f"{seconds * 1e3:,.1f} / {peak / 2**20:,.1f}")
                peaks.append((n, peak))
            growth = [b / a for (n0, a), (n1, b) in zip(peaks, peaks[1:]) if n1 == 2 * n0 and a > 0]
            growth_s = ", ".join(f"{g:.1f}" for g in growth) or "-"
            print(f"| {mask_name} | {backend} | {passes} | " + " | ".join(cells) + f" | {growth_s} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
