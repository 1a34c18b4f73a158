"""Model FLOPs utilisation of a ~1B Llama-style decoder on one GPU, per attention backend, with and without
torch.compile and activation checkpointing, next to transformers.LlamaForCausalLM on the same GPU.

MFU = tokens/s x training FLOPs per token (``megatransformer.flops``: 6N per token plus attention over the full
L x L square) / the GPU's dense bf16 peak (H100/H200 SXM: 989 TFLOP/s; override with --peak-tflops).
The step is the one ``megatransformer train precision=bf16`` runs: bf16 weights and activations, fp32 master
weights in AdamW (DeepSpeed's bf16 mode, mimicked by ``bench/train_step.py``'s Runner), fp32 cross-entropy.

Needs a CUDA GPU; on a machine without one it says so and exits with status 2. ``--cpu-smoke`` runs the same
code path with a tiny model on the CPU (checks the script, measures nothing meaningful).

    python bench/mfu.py                                   # 1.1B (TinyLlama shape), batch 4 x 2048
    python bench/mfu.py --backends flash,sdpa --compile both --ac off
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

from train_step import Runner, make_batch  # noqa: E402

from megatransformer.config import ModelConfig  # noqa: E402
from megatransformer.flops import model_size  # noqa: E402
from megatransformer.hf import llama_config  # noqa: E402
from megatransformer.model import build_model  # noqa: E402

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
    p.add_argument("--backends", default="flash,sdpa,flex", help="ours; flash is skipped when not installed")
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
    else:
        args.device = "cuda"
    return args


def gpu_peak(args: argparse.Namespace) -> float:
    if args.peak_tflops:
        return args.peak_tflops
    name = torch.cuda.get_device_name()
    for key, value in PEAK_TFLOPS.items():
        if key in name:
            return value
    raise SystemExit(f"unknown GPU {name!r}: pass --peak-tflops (its dense bf16 peak)")


def flash_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def make_runner(cfg: ModelConfig, impl: str, backend: str, compile_: bool, ac: bool, args) -> Runner:
    torch.manual_seed(0)
    if impl == "ours":
        model = build_model(cfg.model_copy(update={"attention_backend": backend, "activation_checkpointing": ac}))
        return Runner("ours", model, "bf16", args.device, compile_)
    import transformers

    attn = {"flash": "flash_attention_2", "sdpa": "sdpa"}[backend]
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**llama_config(cfg), attn_implementation=attn))
    if ac:  # transformers >= 5.x name, older name otherwise
        (getattr(hf, "activation_checkpointing_enable", None) or hf.gradient_checkpointing_enable)()
    return Runner("hf", hf, "bf16", args.device, compile_)


def run_config(cfg, impl, backend, compile_, ac, args, batch) -> dict:
    runner = make_runner(cfg, impl, backend, compile_, ac, args)
    cuda = args.device == "cuda"
    try:
        for _ in range(args.warmup):
            runner.step(*batch)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            runner.step(*batch)  # ends in loss.item(): synchronised
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
    batch = make_batch(cfg, argparse.Namespace(batch=args.batch, seq=args.seq, device=args.device))
    tokens = args.batch * args.seq
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (smoke test)"
    print(f"# {datetime.date.today()} {device_name} torch={torch.__version__} flash_attn={flash_available()}")
    print(
        f"# model {args.preset}: {size.params / 1e9:.2f}B params, {size.flops_per_token / 1e9:.2f} GFLOP/token"
        f" at seq {args.seq}; batch {args.batch} x {args.seq}; bf16 weights + fp32 master AdamW;"
        f" peak {peak} TFLOP/s; median of {args.steps} steps after {args.warmup}"
    )
    print(f"# command: python {' '.join(sys.argv)}")
    print("| impl | attention | compile | act. ckpt | tokens/s | MFU | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    flags = {"off": [False], "on": [True], "both": [False, True]}
    impls = [("ours", b) for b in args.backends.split(",")]
    if not args.no_hf:
        impls += [("hf", b) for b in ("flash", "sdpa")]
    for impl, backend in impls:
        if backend == "flash" and not flash_available():
            print(f"| {impl} | flash | - | - | - | - | flash-attn not installed |")
            continue
        for compile_ in flags[args.compile]:
            for ac in flags[args.ac]:
                r = run_config(cfg, impl, backend, compile_, ac, args, batch)
                if r["step_s"] is None:
                    print(f"| {impl} | {backend} | {compile_} | {ac} | {r['note']} | - | - |", flush=True)
                    continue
                tps = tokens / r["step_s"]
                mfu = tps * size.flops_per_token / (peak * 1e12)
                print(
                    f"| {impl} | {backend} | {compile_} | {ac} | {tps:,.0f} | {100 * mfu:.1f}% | {r['peak_gib']:.1f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
