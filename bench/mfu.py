"""Model FLOPs utilisation of a ~1B Llama-style decoder on one GPU, per attention backend, with and without
torch.compile and activation checkpointing, next to transformers.LlamaForCausalLM on the same GPU.

The bare step, like for like with the trainer's (``megatransformer train precision=bf16``): bf16 weights and
activations, fp32 master weights in PyTorch's fused AdamW with the run config's defaults (betas, eps, weight
decay; DeepSpeed's bf16 mode, mimicked by ``bench/train_step.py``'s Runner), the global gradient norm clipped
to ``train.grad_clip`` (foreach kernels), the loss fused into the head in the chunks the head uses.
``--documents 512,1024,512`` packs documents of those lengths into every row (segment and position ids, the
masks and varlen metadata built as the trainer builds them); without it every row is one document.

MFU = model FLOPs / s / the GPU's dense bf16 peak (H100/H200 SXM: 989 TFLOP/s; override with --peak-tflops); the
model FLOPs are ``megatransformer.flops.documents_flops``, the trainer's numerator: 6N per token plus attention
over each document's own square (full rows: the L x L square).

Needs a CUDA GPU; on a machine without one it says so and exits with status 2. ``--cpu-smoke`` runs the same
code path with a tiny model on the CPU (checks the script, measures nothing meaningful).

    python bench/mfu.py                                   # 1.1B (TinyLlama shape), batch 4 x 2048
    python bench/mfu.py --backends fa4,flash,sdpa --compile on --ac off --documents 256,512,1280
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_step import Runner  # noqa: E402

from megatransformer.batch import IGNORE_INDEX  # noqa: E402
from megatransformer.config import ModelConfig, OptimConfig, TrainConfig  # noqa: E402
from megatransformer.flops import document_lengths, documents_flops, model_size  # noqa: E402
from megatransformer.hf.llama import llama_config  # noqa: E402
from megatransformer.model import build_model, gpu_cores  # noqa: E402
from megatransformer.model.attention import flash_attn_installed  # noqa: E402
from megatransformer.training.engine.train_module import batch_to_device  # noqa: E402

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}  # dense bf16
PRESETS = {
    "1b": dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632, vocab_size=32000),
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128, vocab_size=256),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument(
        "--backends", default="fa4,flash,sdpa,flex", help="ours; fa4, fa3 and flash are skipped when not installed"
    )
    p.add_argument("--documents", default="", help="lengths of the documents packed into each row (default: one)")
    p.add_argument("--compile", choices=["off", "on", "both"], default="both")
    p.add_argument("--ac", choices=["off", "on", "both"], default="both", help="activation checkpointing")
    p.add_argument("--no-hf", action="store_true", help="skip transformers.LlamaForCausalLM")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak (default: from GPU name)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU: checks the script only")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        args.preset, args.batch, args.seq, args.steps, args.warmup = "tiny", 2, 64, 1, 1
        args.backends, args.compile = "sdpa,chunked", "off"  # flex cannot train on CPU; compile is slow here
        args.device, args.peak_tflops = "cpu", args.peak_tflops or 1.0
        args.documents = "24,40" if args.documents else ""
    else:
        args.device = "cuda"
    args.lengths = [int(n) for n in args.documents.split(",") if n]
    if sum(args.lengths) > args.seq:
        p.error(f"--documents {args.documents} add up to more than --seq {args.seq}")
    return args


def gpu_peak(args: argparse.Namespace) -> float:
    if args.peak_tflops:
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops (its dense bf16 peak)")


def installed(backend: str) -> bool:
    if backend in gpu_cores.REGISTRY_IMPLS:
        return gpu_cores.registry_impl_installed(backend)
    return backend != "flash" or flash_attn_installed()


def trainer_adamw() -> dict:
    """PyTorch's fused AdamW with the run config's defaults, as the trainer hands it to DeepSpeed."""
    o = OptimConfig()
    return dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=True)


def make_runner(cfg: ModelConfig, impl: str, backend: str, compile_: bool, ac: bool, args) -> Runner:
    torch.manual_seed(0)
    like_the_trainer = dict(adamw=trainer_adamw(), grad_clip=TrainConfig().grad_clip)
    if impl == "ours":
        gpu_cores.activate_for(backend, args.device)
        model = build_model(cfg.model_copy(update={"attention_backend": backend, "activation_checkpointing": ac}))
        return Runner("ours", model, "bf16", args.device, compile_, **like_the_trainer)
    import transformers

    attn = {"flash": "flash_attention_2", "sdpa": "sdpa"}[backend]
    hf = transformers.LlamaConfig(**llama_config(cfg), attn_implementation=attn)
    hf = transformers.LlamaForCausalLM(hf)
    if ac:  # transformers >= 5.x name, older name otherwise
        (getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable)()
    return Runner("hf", hf, "bf16", args.device, compile_, **like_the_trainer)


def make_rows(cfg: ModelConfig, args) -> dict[str, torch.Tensor]:
    """A host batch as the loader makes it: random tokens, labels, and with ``--documents`` the rows' segment
    and position ids (documents back to back, padding after them)."""
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (args.batch, args.seq + 1), generator=g)
    batch = {"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()}
    if args.lengths:
        segments = torch.zeros(args.seq, dtype=torch.long)
        positions = torch.zeros(args.seq, dtype=torch.long)
        start = 0
        for document, length in enumerate(args.lengths, 1):
            segments[start : start + length] = document
            positions[start : start + length] = torch.arange(length)
            start += length
        batch["labels"][:, start:] = IGNORE_INDEX
        batch["segment_ids"] = segments.expand(args.batch, -1).contiguous()
        batch["position_ids"] = positions.expand(args.batch, -1).contiguous()
    return batch


def device_batch(rows: dict[str, torch.Tensor], impl: str, args) -> tuple[tuple, dict]:
    """The step's arguments on the device: our model takes the trainer's masks (with varlen metadata on CUDA);
    transformers' takes plain rows (it attends across packed documents, so it is timed on full rows only)."""
    if impl == "hf":
        return (rows["input_ids"].to(args.device), rows["labels"].to(args.device)), {}
    inputs, labels, masks = batch_to_device(rows, torch.device(args.device), "decoder", varlen=args.device == "cuda")
    return (inputs.pop("input_ids"), labels), {**inputs, "masks": masks}


def run_config(cfg, impl, backend, compile_, ac, args, rows) -> dict:
    runner = make_runner(cfg, impl, backend, compile_, ac, args)
    batch, inputs = device_batch(rows, impl, args)
    cuda = args.device == "cuda"
    try:
        for _ in range(args.warmup):
            runner.step(*batch, **inputs)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            runner.step(*batch, **inputs)  # ends in loss.item(): synchronised
            times.append(time.perf_counter() - start)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        return dict(step_s=statistics.median(times), peak_gib=peak)
    except torch.OutOfMemoryError:
        return dict(step_s=None, peak_gib=None, note="out of memory")
    finally:
        del runner
        if cuda:
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            "bench/mfu.py needs a CUDA GPU and this machine has none (torch.cuda.is_available() is False); "
            "GPU MFU is not measured here. Run it on a GPU machine, or --cpu-smoke to check the script."
        )
        return 2
    cfg = ModelConfig(**PRESETS[args.preset], max_seq_len=args.seq, tie_embeddings=False, norm_eps=1e-5)
    size = model_size(cfg, args.seq)
    peak = gpu_peak(args) if args.device == "cuda" else args.peak_tflops
    rows = make_rows(cfg, args)
    segments = rows.get("segment_ids")
    step_flops = documents_flops(
        size, document_lengths(None if segments is None else segments.numpy(), (args.batch, args.seq))
    )
    tokens = args.batch * args.seq
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke test)"
    print(f"# {datetime.date.today()} {device_name} torch={torch.__version__} flash_attn={flash_attn_installed()}")
    rows_are = f"documents {args.documents} per row" if args.lengths else "one document per row"
    print(
        f"# model {args.preset}: {size.params / 1e9:.2f}B params, {step_flops / tokens / 1e9:.2f} GFLOP/token"
        f" ({rows_are}); batch {args.batch} x {args.seq}; bf16 weights + fp32 master fused AdamW, clip"
        f" {TrainConfig().grad_clip}; peak {peak} TFLOP/s; median of {args.steps} steps after {args.warmup}"
    )
    print(f"# command: python {' '.join(sys.argv)}")
    print("| impl | attention | compile | act. ckpt | tokens/s | MFU | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    flags = {"off": [False], "on": [True], "both": [False, True]}
    impls = [("ours", b) for b in args.backends.split(",")]
    if not args.no_hf and not args.lengths:
        impls += [("hf", b) for b in ("flash", "sdpa")]
    for impl, backend in impls:
        if not installed(backend):
            print(f"| {impl} | {backend} | - | - | - | - | not installed |")
            continue
        for compile_ in flags[args.compile]:
            for ac in flags[args.ac]:
                r = run_config(cfg, impl, backend, compile_, ac, args, rows)
                if r["step_s"] is None:
                    print(f"| {impl} | {backend} | {compile_} | {ac} | {r['note']} | - | - |", flush=True)
                    continue
                mfu = step_flops / r["step_s"] / (peak * 1e12)
                print(
                    f"| {impl} | {backend} | {compile_} | {ac} | {tokens / r['step_s']:,.0f} | {100 * mfu:.1f}% "
                    f"| {r['peak_gib']:.1f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
