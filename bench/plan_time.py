"""The planner's step time against the trainer's own tokens/s on this machine's CPU, at a few model sizes.

Each size is a real ``megatransformer train`` process (one rank, fp32, a decoder on a corpus the project writes
itself); its tokens/s is the median of the logged steps after the first two. The plan's tokens/s is the step's
tokens over ``planner.step_seconds`` for the same layout, with the CPU's GEMM speed measured by the planner
(``plan``'s ``cpu_tflops``) in the same minutes. The ratio says how far the time model is on this CPU; there
is no target on a CPU (docs/planner.md).

    python bench/plan_time.py
    python bench/plan_time.py --steps 12 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = {  # d_model, layers, heads, kv heads, d_ff
    "d128-L2": (128, 2, 4, 2, 352),
    "d256-L4": (256, 4, 8, 4, 704),
    "d512-L8": (512, 8, 8, 4, 1408),
}


def prepare_data(root: Path) -> tuple[Path, Path]:
    from data_pipeline.corpus import write_demo_corpus
    from data_pipeline.shard import write_shards
    from data_pipeline.tokenizer import train_tokenizer

    corpus = write_demo_corpus(root / "corpus.txt", max_bytes=1_000_000)
    tokenizer = root / "tokenizer.json"
    train_tokenizer([str(corpus)], 2048, tokenizer)
    write_shards([str(corpus)], str(tokenizer), root / "shards", shard_mb=1, valid_every=50, workers=1, progress=False)
    return tokenizer, root / "shards"


def overrides(size: str, run_dir: Path, tokenizer: Path, shards: Path, args: argparse.Namespace) -> list[str]:
    d, layers, heads, kv, ff = SIZES[size]
    return [
        f"model.d_model={d}",
        f"model.n_layers={layers}",
        f"model.n_heads={heads}",
        f"model.n_kv_heads={kv}",
        f"model.d_ff={ff}",
        "model.vocab_size=2048",
        f"model.max_seq_len={args.seq}",
        f"data.seq_len={args.seq}",
        f"data.train={shards}",
        f"data.tokenizer={tokenizer}",
        f"train.micro_batch_size={args.batch}",
        "train.grad_accum=1",
        "train.global_batch_size=null",
        f"train.max_steps={args.steps}",
        "train.log_every=1",
        "train.eval_batches=1",
        "checkpoint.every=100000",
        "precision=fp32",
        "parallel.zero_stage=0",
        "wandb.mode=disabled",
        f"run_dir={run_dir}",
    ]


def measured_tokens_per_s(run_dir: Path) -> float:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    speeds = [r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > 2]
    return statistics.median(speeds)


def planned_tokens_per_s(words: list[str]) -> tuple[float, float]:
    from megatransformer.commands.plan import config_layout, cpu_tflops
    from megatransformer.config import load_config
    from megatransformer.flops import model_size
    from megatransformer.planner import cpu_device, step_seconds

    cfg = load_config("quickstart", words)
    layout, _ = config_layout(cfg, 1, "cpu")
    peak = cpu_tflops(cfg.precision)
    device = cpu_device()
    device = type(device)(**{**device.__dict__, "peak_tflops": peak})
    seconds = step_seconds(cfg, layout, device, 1, model_size(cfg.model, cfg.data.seq_len).flops_per_token)
    return layout.micro_batch * layout.accum * cfg.data.seq_len / seconds, peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="training steps per size")
    parser.add_argument("--seq", type=int, default=512, help="sequence length")
    parser.add_argument("--batch", type=int, default=4, help="micro batch (rows)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of the training processes")
    parser.add_argument("--sizes", default=",".join(SIZES), help="comma list of " + ", ".join(SIZES))
    args = parser.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    import torch

    torch.set_num_threads(args.threads)
    print(f"| size | trainer tokens/s | plan tokens/s | plan / trainer | CPU GEMM GFLOP/s ({args.threads} threads) |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer, shards = prepare_data(Path(tmp))
        for size in args.sizes.split(","):
            run_dir = Path(tmp) / size
            words = overrides(size, run_dir, tokenizer, shards, args)
            command = [sys.executable, "-m", "megatransformer", "train", "--config", "quickstart", *words]
            subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
            trainer = measured_tokens_per_s(run_dir)
            plan, peak = planned_tokens_per_s(words)
            print(f"| {size} | {trainer:,.0f} | {plan:,.0f} | {plan / trainer:.2f} | {peak * 1e3:,.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
