"""``megatransformer plot RUN_DIR... --out PNG``: loss, validation loss and throughput of one or more runs."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("plot", help="draw loss and throughput curves of runs to a PNG")
    p.add_argument("runs", nargs="+", help="run directories (holding metrics.jsonl)")
    p.add_argument("--out", default="runs.png", help="PNG file to write")
    p.set_defaults(func=run)


def read_metrics(run_dir: Path) -> list[dict]:
    from megatransformer.config import ConfigError

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl (is it a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run(args: argparse.Namespace) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, speed_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    for run_dir in args.runs:
        records = read_metrics(Path(run_dir))
        name = Path(run_dir).name
        train = [r for r in records if r.get("loss") is not None]
        valid = [r for r in records if "val_loss" in r]
        loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], label=f"{name} train")
        if valid:
            loss_ax.plot([r["step"] for r in valid], [r["val_loss"] for r in valid], "o--", label=f"{name} valid")
        speed_ax.plot([r["step"] for r in train], [r.get("tokens_per_s", 0) for r in train], label=name)
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    speed_ax.set(xlabel="step", ylabel="tokens / s", title="throughput")
    for ax in (loss_ax, speed_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=100)
    print(f"wrote {args.out}")
    return 0
