"""The training loss: the plain head (logits, fp32 cross-entropy) against the fused head
(``megatransformer.model.head.linear_cross_entropy``), forward + backward, time and peak memory.

Both take hidden states [tokens, d_model] and the head's weight [vocab, d_model] in the compute dtype and
return the summed token loss; one step is the loss and its backward (gradients of the hidden states and the
weight). Memory is the peak of live tensor bytes above the inputs (``bench/attention.py``'s ``peak_bytes``:
the profiler's allocator events on CPU, ``max_memory_allocated`` on CUDA). Cases alternate, in one process.

    python bench/loss.py                                    # fp32, 2048 tokens, d 512, vocab 2048 and 32000
    python bench/loss.py --precision bf16 --tokens 8192 --d-model 2048 --vocab 32000,128256 --device cuda
    python bench/loss.py --z-loss 1e-4                      # both heads with the z-loss (train.z_loss)
"""

from __future__ import annotations

import argparse
import datetime
import functools
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attention import peak_bytes  # noqa: E402

from megatransformer.config import precision_dtype  # noqa: E402
from megatransformer.model.head import linear_cross_entropy, plain_cross_entropy  # noqa: E402


def plain(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0):
    return plain_cross_entropy(F.linear(hidden, weight), labels, z_loss=z_loss)


def heads(chunk_logits: list[int], z_loss: float = 0.0) -> dict:
    """The plain head, and the fused one at each chunk size (its default where none is given), with the
    z-loss ``z_loss``."""
    compared = {"plain": functools.partial(plain, z_loss=z_loss)}
    if not chunk_logits:
        return compared | {"fused": functools.partial(linear_cross_entropy, z_loss=z_loss)}
    for c in chunk_logits:
        compared[f"fused {c >> 20}M"] = functools.partial(linear_cross_entropy, chunk_logits=c, z_loss=z_loss)
    return compared


def step(head, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> None:
    h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    loss = head(h, w, labels)
    (loss[0] if isinstance(loss, tuple) else loss).backward()  # (with a z-loss: the loss and its z-loss part)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"))
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--vocab", default="2048,32000", help="comma-separated vocabulary sizes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunk-logits", default="", help="comma-separated logits per chunk of the fused head, e.g. 8M,64M")
    p.add_argument("--z-loss", type=float, default=0.0, help="z-loss coefficient of both heads (train.z_loss)")
    args = p.parse_args()
    compared = heads([int(c.rstrip("M")) << 20 for c in args.chunk_logits.split(",") if c], args.z_loss)
    dtype, device = precision_dtype(args.precision), args.device
    print(
        f"# bench/loss.py {datetime.date.today()}: {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, device {device}, {args.precision}, "
        f"{args.tokens} tokens, d_model {args.d_model}, z_loss {args.z_loss}"
    )
    print("| vocab | head | s/step median (min-max) | peak memory above inputs | vs plain |")
    print("|---|---|---|---|---|")
    for vocab in map(int, args.vocab.split(",")):
        gen = torch.Generator().manual_seed(0)
        hidden = torch.randn(args.tokens, args.d_model, generator=gen).to(device, dtype)
        weight = (torch.randn(vocab, args.d_model, generator=gen) * 0.02).to(device, dtype)
        labels = torch.randint(0, vocab, (args.tokens,), generator=gen).to(device)
        times: dict[str, list[float]] = {name: [] for name in compared}
        for head in compared.values():  # (warm-up)
            step(head, hidden, weight, labels)
        for i in range(args.repeats):
            for name in compared if i % 2 == 0 else reversed(compared):
                sync(device)
                start = time.perf_counter()
                step(compared[name], hidden, weight, labels)
                sync(device)
                times[name].append(time.perf_counter() - start)
        peaks = {
            name: peak_bytes(lambda: step(head, hidden, weight, labels), device) for name, head in compared.items()
        }
        for name in compared:
            t = times[name]
            ratio = statistics.median(times["plain"]) / statistics.median(t)
            print(
                f"| {vocab} | {name} | {statistics.median(t):.4f} ({min(t):.4f}-{max(t):.4f}) | "
                f"{peaks[name] / 2**20:,.0f} MiB | {ratio:.2f}x speed, "
                f"{peaks[name] / peaks['plain']:.2f}x memory |"
            )


if __name__ == "__main__":
    main()
