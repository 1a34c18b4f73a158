"""Multi-head latent attention against grouped-query attention at about equal parameters, side by side.

Two decoders of the same width and depth: GQA (``--kv-heads`` key/value heads) and MLA (a ``--kv-lora-rank``
latent and a ``--rope-dim`` RoPE key per token), the MLA model's MLP widened until the parameter counts
match. Measured in one run, alternating the two models every round (the order reversed on odd rounds) so
that load from other processes hits both alike; reported as medians and the MLA/GQA ratios:

- KV-cache bytes per token (all layers), read from the caches generation allocates;
- generation tokens/s: greedy decoding of ``--new`` tokens after a ``--prompt``-token prompt, with the cache;
- the training step (forward, backward, AdamW; the trainer's fused loss) in tokens/s, and its peak memory
  (live tensor bytes, from the profiler's allocation events, plus the state alive before the step).

    python bench/latent_attention.py                       # d512 L8 H8, GQA-4 vs MLA rank 128 + rope 16
    python bench/latent_attention.py --rounds 5 --threads 1 --clock cpu
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

from train_step import Runner, peak_step_bytes, timed_steps  # noqa: E402

from megatransformer.config import ModelConfig  # noqa: E402
from megatransformer.model import build_model  # noqa: E402
from megatransformer.model.generate import generate  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4, help="GQA's key/value heads")
    p.add_argument("--ffn", type=int, default=1408, help="GQA's SwiGLU width (MLA's is matched to its parameters)")
    p.add_argument("--kv-lora-rank", type=int, default=128)
    p.add_argument("--rope-dim", type=int, default=16, help="MLA's qk_rope_head_dim")
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--batch", type=int, default=4, help="rows of the training batch and of generation")
    p.add_argument("--seq", type=int, default=512, help="tokens per training row")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128, help="generated tokens per row")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=2, help="timed training steps per model and round")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    return p.parse_args()


def configs(args: argparse.Namespace) -> dict[str, ModelConfig]:
    base = dict(
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        vocab_size=args.vocab,
        max_seq_len=max(args.seq, args.prompt + args.new),
        tie_embeddings=False,
    )
    gqa = ModelConfig(**base, n_kv_heads=args.kv_heads, d_ff=args.ffn)
    head = args.d_model // args.heads
    mla = dict(attention="mla", kv_lora_rank=args.kv_lora_rank, qk_rope_head_dim=args.rope_dim, v_head_dim=head)
    params = {
        name: parameters(cfg) for name, cfg in {"gqa": gqa, "mla": ModelConfig(**base, **mla, d_ff=args.ffn)}.items()
    }
    extra = round((params["gqa"] - params["mla"]) / (3 * args.d_model * args.layers))  # SwiGLU: 3 d per unit
    return {"gqa": gqa, "mla": ModelConfig(**base, **mla, d_ff=args.ffn + extra)}


def parameters(cfg: ModelConfig) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg).parameters())


def cache_bytes_per_token(model, max_len: int) -> int:
    caches = model.new_caches(1, max_len)
    return sum(c.k.nbytes + c.v.nbytes for c in caches) // max_len


def generation_seconds(model, prompt: torch.Tensor, new: int, clock) -> float:
    start = clock()
    generate(model, prompt, new)
    return clock() - start


def main() -> None:
    args = parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    cfgs = configs(args)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, args.vocab, (args.batch, args.prompt), generator=gen)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    batch = (ids, ids.roll(-1, dims=1))
    models, runners = {}, {}
    for name, cfg in cfgs.items():
        torch.manual_seed(0)
        models[name] = build_model(cfg).eval()
        runners[name] = Runner(name, build_model(cfg), "fp32", "cpu", False)
        generation_seconds(models[name], prompt, 4, clock)  # warm-up
        runners[name].step(*batch)
    gen_times = {name: [] for name in cfgs}
    step_times = {name: [] for name in cfgs}
    for r in range(args.rounds):
        for name in cfgs if r % 2 == 0 else reversed(list(cfgs)):
            with torch.no_grad():
                gen_times[name].append(generation_seconds(models[name], prompt, args.new, clock))
            step_times[name].append(timed_steps(runners[name], batch, args.steps, args.clock))
    peaks = {name: peak_step_bytes(runners[name], batch) for name in cfgs}

    rows = {}
    for name, cfg in cfgs.items():
        rows[name] = {
            "params": parameters(cfg),
            "cache": cache_bytes_per_token(models[name], args.prompt + args.new),
            "gen": args.batch * args.new / statistics.median(gen_times[name]),
            "train": args.batch * args.seq / statistics.median(step_times[name]),
            "peak": peaks[name] / 2**20,
        }
    ratios = {
        "gen": statistics.median(g / m for g, m in zip(gen_times["gqa"], gen_times["mla"])),
        "train": statistics.median(g / m for g, m in zip(step_times["gqa"], step_times["mla"])),
    }
    cpu = platform.processor() or platform.machine()
    print(
        f"# {datetime.datetime.now():%Y-%m-%d %H:%M} {cpu}, torch {torch.__version__}, "
        f"threads {torch.get_num_threads()}, {args.clock} clock"
    )
    gqa, mla = cfgs["gqa"], cfgs["mla"]
    print(
        f"# d{args.d_model} L{args.layers} H{args.heads}, fp32; GQA-{gqa.kv_heads} d_ff {gqa.d_ff}; MLA rank "
        f"{mla.kv_lora_rank} + rope {mla.qk_rope_head_dim}, nope {mla.qk_nope_head_dim}, v {mla.v_head_dim}, "
        f"d_ff {mla.d_ff}"
    )
    print(
        f"# generation: batch {args.batch}, prompt {args.prompt}, {args.new} new tokens; "
        f"training: {args.batch} x {args.seq}"
    )
    print("| model | parameters | KV cache bytes/token | generation tokens/s | training tokens/s | step peak MiB |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        print(
            f"| {name.upper()} | {row['params']:,} | {row['cache']:,} | {row['gen']:,.0f} | {row['train']:,.0f} "
            f"| {row['peak']:,.0f} |"
        )
    print(
        f"| MLA / GQA | {rows['mla']['params'] / rows['gqa']['params']:.3f}x | "
        f"{rows['mla']['cache'] / rows['gqa']['cache']:.3f}x | {ratios['gen']:.2f}x | {ratios['train']:.2f}x | "
        f"{rows['mla']['peak'] / rows['gqa']['peak']:.2f}x |"
    )


if __name__ == "__main__":
    main()
