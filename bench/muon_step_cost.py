"""Muon's cost per training step against AdamW's, as the batch grows: the trainer end to end, side by side.

Newton-Schulz costs the same at any batch (five iterations of three matrix products per hidden matrix and step),
while the forward and backward grow with the tokens of a step; so Muon's step costs more than AdamW's at small
batches, and the ratio falls as the batch grows. For each micro batch size, the trainer runs with AdamW and
with Muon (the same config, seed and batches; the order reversed every other round) and the step time is the
median gap between consecutive steps' log records after ``--warmup`` steps, logging every step.

    python bench/muon_step_cost.py --config configs/quickstart.yaml --micro-batches 8,32,128 \\
        model.d_model=512 model.n_layers=6 model.n_heads=8 model.n_kv_heads=4 model.d_ff=1408   # ~20M
    python bench/muon_step_cost.py --config /dev/null --micro-batches 2,4 --steps 2 model.d_model=64 ...  # smoke
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

OPTIMIZERS = ("adamw", "muon")


def step_times(args: argparse.Namespace, optimizer: str, micro: int, work: Path) -> tuple[list[float], int]:
    """One run's seconds between consecutive steps after the warm-up, and the tokens of a step."""
    run_dir = work / f"{optimizer}-mb{micro}"
    shutil.rmtree(run_dir, ignore_errors=True)
    steps = args.warmup + args.steps
    command = [
        *(sys.executable, "-m", "megatransformer.cli", "train", "--config", args.config),
        *args.overrides,
        f"run_dir={run_dir}",
        f"optim.name={optimizer}",
        f"train.micro_batch_size={micro}",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        f"checkpoint.every={steps}",
        "wandb.mode=disabled",
    ]
    result = subprocess.run(command, capture_output=True, text=True, env=os.environ)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\nexit {result.returncode}\n{result.stderr[-3000:]}")
    return step_gaps([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()], args.warmup)


def step_gaps(records: list[dict], warmup: int) -> tuple[list[float], int]:
    """The seconds between consecutive train records after step ``warmup`` (one record a step), and the tokens
    of a step."""
    train = [r for r in records if r.get("kind") == "train"]
    if [r["step"] for r in train] != list(range(1, len(train) + 1)) or len(train) < warmup + 2:
        raise SystemExit(f"expected a train record every step and more than {warmup + 1} steps")
    gaps = [b["time"] - a["time"] for a, b in zip(train, train[1:]) if a["step"] >= warmup]
    return gaps, train[1]["tokens"] - train[0]["tokens"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="the run's YAML (its model, data and sequence length)")
    p.add_argument("--micro-batches", default="8,32,128", help="train.micro_batch_size values, comma-separated")
    p.add_argument("--steps", type=int, default=6, help="timed steps of every run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=2, help="runs of each optimizer per batch (order alternated)")
    p.add_argument("--work", default=None, help="directory of the runs (default: a temporary one, removed)")
    p.add_argument("overrides", nargs="*", help="key.path=value overrides of every run")
    args = p.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="muon_step_cost-"))
    rows = []
    for micro in (int(m) for m in args.micro_batches.split(",")):
        times: dict[str, list[float]] = {name: [] for name in OPTIMIZERS}
        for round_ in range(args.rounds):
            for optimizer in OPTIMIZERS if round_ % 2 == 0 else reversed(OPTIMIZERS):
                seconds, tokens = step_times(args, optimizer, micro, work)
                times[optimizer] += seconds
        adamw, muon = (statistics.median(times[name]) for name in OPTIMIZERS)
        rows.append((tokens, micro, adamw, muon))
        print(f"  {tokens:>7,} tokens a step: AdamW {adamw:.3f} s, Muon {muon:.3f} s, {muon / adamw:.2f}x", flush=True)
    if args.work is None:
        shutil.rmtree(work)
    print("\n| tokens a step | micro batch | AdamW s/step | Muon s/step | Muon / AdamW | Muon's extra, s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for tokens, micro, adamw, muon in rows:
        print(f"| {tokens:,} | {micro} | {adamw:.3f} | {muon:.3f} | {muon / adamw:.2f}x | {muon - adamw:.3f} |")


if __name__ == "__main__":
    main()
