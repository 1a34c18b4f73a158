"""Checkpoint cost of `megatransformer train`, this checkout side by side with another one (the code before).

Each tree trains the same model on the same data for ``--steps`` steps with a checkpoint every ``--every``,
then resumes the last checkpoint for one more step. Measured from the outside, alike for both trees:
- bytes a parameter: the newest checkpoint directory's bytes / the model's parameters (12 is the minimum for
  an exact resume in fp32: weights and Adam's two moments);
- stall: the gap between the logged steps around a save, less the median gap between steps without one;
- write: where the tree logs it (``ckpt_write_s`` in metrics.jsonl), the background write's seconds;
- peak host memory: the largest resident set of any rank process (ru_maxrss of the children), saving run
  and resuming run apart;
- resume: the resuming run's wall time less a fresh one-step run's (the loading, beside the start-up both pay).

    python bench/checkpoint.py --before /path/to/old/checkout                       # ~50M parameters, 1 rank
    python bench/checkpoint.py --before OLD --d-model 768 --layers 16 --nproc 2 --zero 3   # ~150M, 2 ranks
    python bench/checkpoint.py --d-model 64 --layers 2 --heads 2 --ffn 128 --vocab 512 --steps 4 --every 2
                                                                                 # a smoke run, this tree only
The figures are side-by-side ratios from one invocation; the machine they came from goes with them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--before", type=Path, help="another checkout to compare with (its code runs its own trainer)")
    p.add_argument("--work", type=Path, default=Path("/tmp/bench_checkpoint"), help="data and run directories")
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--ffn", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--zero", type=int, default=2, choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=9)
    p.add_argument("--every", type=int, default=3)
    return p.parse_args(argv)


def env_for(tree: Path) -> dict[str, str]:
    return dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        PYTHONPATH=os.pathsep.join([str(tree), str(tree / "tests")]),
    )


def cli(tree: Path, nproc: int, *words: str) -> tuple[float, int]:
    """Run ``megatransformer WORDS`` from ``tree``; (wall seconds, peak RSS in bytes of the largest process of
    the run: wait4's usage of a child covers the descendants it waited for, torchrun's ranks among them)."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    command = [*(launcher if nproc > 1 else [sys.executable]), "-m", "megatransformer.cli", *words]
    began = time.perf_counter()
    child = subprocess.Popen(command, env=env_for(tree), cwd=tree, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    if child.returncode != 0:
        raise SystemExit(f"bench: {' '.join(words[:3])} failed in {tree} (exit {child.returncode})")
    return time.perf_counter() - began, usage.ru_maxrss * 1024


def prepare_data(args: argparse.Namespace) -> tuple[Path, Path]:
    work = args.work
    shards, tokenizer, corpus = work / "shards", work / "tokenizer.json", work / "corpus.txt"
    if (shards / "manifest.json").is_file():
        return shards, tokenizer
    work.mkdir(parents=True, exist_ok=True)
    for words in (
        ("data", "demo-corpus", "--out", str(corpus)),
        ("data", "tokenizer", "--input", str(corpus), "--vocab-size", str(args.vocab), "--out", str(tokenizer)),
        ("data", "shard", "--input", str(corpus), "--tokenizer", str(tokenizer), "--out", str(shards), "--overwrite"),
    ):
        cli(ROOT, 1, *words)
    return shards, tokenizer


def overrides(args: argparse.Namespace, run_dir: Path, steps: int, shards: Path, tokenizer: Path) -> list[str]:
    return [
        "--config",
        os.devnull,
        f"run_dir={run_dir}",
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        f"model.n_heads={args.heads}",
        f"model.n_kv_heads={args.heads}",
        f"model.d_ff={args.ffn}",
        f"model.vocab_size={args.vocab}",
        f"model.max_seq_len={args.seq}",
        f"data.train={shards}",
        f"data.tokenizer={tokenizer}",
        f"data.seq_len={args.seq}",
        f"train.micro_batch_size={args.batch}",
        "train.grad_accum=1",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        f"checkpoint.every={args.every}",
        f"checkpoint.keep={steps}",
        f"parallel.zero_stage={args.zero}",
        "wandb.mode=disabled",
    ]


def measure(tree: Path, args: argparse.Namespace, shards: Path, tokenizer: Path) -> dict[str, float]:
    runs = args.work / "runs" / tree.name
    shutil.rmtree(runs, ignore_errors=True)
    saving, fresh, resumed = runs / "saving", runs / "fresh", runs / "resumed"
    _, save_peak = cli(tree, args.nproc, "train", *overrides(args, saving, args.steps, shards, tokenizer))
    fresh_s, _ = cli(tree, args.nproc, "train", *overrides(args, fresh, 1, shards, tokenizer))
    step = (args.steps - 1) // args.every * args.every  # the last periodic save
    last = saving / "checkpoints" / f"step_{step:06d}"
    resume_s, resume_peak = cli(
        tree, args.nproc, "train", *overrides(args, resumed, step + 1, shards, tokenizer), f"resume={last}"
    )
    records = [json.loads(line) for line in (saving / "metrics.jsonl").read_text().splitlines()]
    times = {r["step"]: r["time"] for r in records if "loss" in r}
    saved = set(range(args.every, args.steps, args.every))
    gaps = {s: times[s + 1] - times[s] for s in range(2, args.steps) if s + 1 in times and s in times}
    plain = statistics.median(g for s, g in gaps.items() if s not in saved)
    stalls = [gaps[s] - plain for s in saved if s in gaps]
    writes = [r["ckpt_write_s"] for r in records if r.get("kind") == "checkpoint"]
    params = parameters(args)
    size = sum(p.stat().st_size for p in last.rglob("*") if p.is_file())
    return {
        "bytes_per_param": size / params,
        "stall_s": statistics.median(stalls) if stalls else float("nan"),
        "write_s": statistics.median(writes) if writes else float("nan"),
        "save_peak_gib": save_peak / 2**30,
        "resume_peak_gib": resume_peak / 2**30,
        "resume_s": resume_s - fresh_s,
    }


def parameters(args: argparse.Namespace) -> int:
    from megatransformer.config import ModelConfig
    from megatransformer.flops import model_size

    model = ModelConfig(
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.heads,
        d_ff=args.ffn,
        vocab_size=args.vocab,
        max_seq_len=args.seq,
    )
    return model_size(model, args.seq).params


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shards, tokenizer = prepare_data(args)
    trees = {"this": ROOT, **({"before": args.before.resolve()} if args.before else {})}
    results = {name: measure(tree, args, shards, tokenizer) for name, tree in trees.items()}
    print(
        f"# {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {parameters(args) / 1e6:.1f}M "
        f"parameters, {args.nproc} rank(s), ZeRO-{args.zero}; a checkpoint every {args.every} of {args.steps} steps"
    )
    names = list(results)
    print("| measure | " + " | ".join(names) + (" | this / before |" if "before" in results else " |"))
    print("|---" * (len(names) + 1 + ("before" in results)) + "|")
    for key in results["this"]:
        values = [results[n][key] for n in names]
        ratio = f" | {values[0] / values[1]:.2f}x" if len(values) == 2 and values[1] else ""
        print(f"| {key} | " + " | ".join(f"{v:.3f}" for v in values) + ratio + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
