"""``megatransformer plot RUN_DIR...``: loss, learning rate, gradient norm, throughput and MFU curves of one or
more runs, and the downstream tasks' metrics (train.evals) where they were evaluated (scores of 0-1 on the left
axis, bits per byte on the right)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

PLOT_NAME = "metrics.png"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plot",
        help="draw loss, learning-rate, gradient-norm, throughput and MFU curves of runs to a PNG",
        description="Draw the curves of metrics.jsonl of one or more runs into one PNG.",
    )
    p.add_argument("runs", nargs="+", help="run directories (holding metrics.jsonl)")
    p.add_argument(
        "--out",
        default=None,
        help=f"PNG file to write (default: RUN_DIR/{PLOT_NAME} for one run, the runs' common "
        "directory/compare.png for several)",
    )
    p.set_defaults(func=run)


def default_out(runs: list[str | Path]) -> Path:
    """Next to the runs: inside the run directory for one run, in the directory holding them all for several."""
    if len(runs) == 1:
        return Path(runs[0]) / PLOT_NAME
    return Path(os.path.commonpath([os.path.abspath(r) for r in runs])) / "compare.png"


PANELS = (
    ("loss", "loss", "loss"),
    ("lr", "learning rate", "learning rate"),
    ("grad_norm", "gradient norm (log scale)", "gradient norm"),
    ("tokens_per_s", "tokens / s", "throughput"),
    ("mfu", "MFU (%)", "model FLOPs utilisation"),
    ("eval/", "metric", "downstream tasks (train.evals; perplexities: in metrics.jsonl)"),
)


def panels(metrics: list[list[dict]]) -> list[tuple[str, str, str]]:
    """(record key, y label, title) of each panel: MFU only when some run has it (a CPU run has none unless
    train.peak_tflops is set), the gradient norm likewise, downstream tasks only when some run evaluated them."""
    has = {key: any(r.get(key) is not None for records in metrics for r in records) for key in ("mfu", "grad_norm")}
    has["eval/"] = bool(eval_keys([r for records in metrics for r in records]))
    return [panel for panel in PANELS if has.get(panel[0], True)]


def eval_keys(records: list[dict]) -> list[str]:
    """The eval/<task>/<metric> keys of records, standard errors left out."""
    keys = {key for r in records for key in r if key.startswith("eval/") and not key.endswith("_stderr")}
    return sorted(keys)


def draw(runs: list[str | Path], out: str | Path) -> Path:
    """Write the panels (loss with validation points and loss-spike events, learning rate, tokens/s, MFU if
    known) to ``out``."""
    from matplotlib.figure import Figure  # (not pyplot: no global figures, and a caller's backend left alone)

    from megatransformer.training.observability.metrics import read_metrics

    metrics = [(run_dir, read_metrics(run_dir)) for run_dir in runs]  # a directory that is no run fails first
    shown = panels([records for _, records in metrics])
    fig = Figure(figsize=(6 * len(shown), 4.5))
    axes = fig.subplots(1, len(shown), squeeze=False)
    bits = None  # the downstream panel's right axis: bits per byte (unbounded) beside the 0-1 scores
    for run_dir, records in metrics:
        name = Path(run_dir).resolve().name
        train = [r for r in records if "loss" in r]
        valid = [r for r in records if "val_loss" in r or eval_keys([r])]
        steps = [r["step"] for r in train]
        for ax, (key, _, _) in zip(axes.flat, shown):
            if key == "eval/":
                for metric in eval_keys(valid):
                    if metric.endswith("perplexity"):  # (unbounded: they would flatten the others; bits_per_byte
                        continue  # says the same)
                    points = [(r["step"], r[metric]) for r in valid if r.get(metric) is not None]
                    if metric.endswith("bits_per_byte"):
                        bits = bits or ax.twinx()
                        bits.plot(*zip(*points), "s--", label=f"{name} {metric.removeprefix('eval/')} (right)")
                    else:
                        ax.plot(*zip(*points), "o-", label=f"{name} {metric.removeprefix('eval/')}")
                continue
            scale = 100 if key == "mfu" else 1
            ax.plot(
                steps,
                [None if r.get(key) is None else scale * r[key] for r in train],
                label=f"{name} train" if key == "loss" else name,
            )
        losses = [(r["step"], r["val_loss"]) for r in valid if "val_loss" in r]
        if losses:
            axes.flat[0].plot(*zip(*losses), "o--", label=f"{name} valid")
        mark_spikes(axes.flat[0], name, [r for r in records if "event" in r])
    for ax, (key, ylabel, title) in zip(axes.flat, shown):
        ax.set(xlabel="step", ylabel=ylabel, title=title)
        ax.grid(alpha=0.3)
        if key == "grad_norm" and any(line.get_ydata().size for line in ax.get_lines()):
            ax.set_yscale("log")
        handles, labels = ax.get_legend_handles_labels()
        if key == "eval/" and bits is not None:
            bits.set_ylabel("bits per byte")
            more = bits.get_legend_handles_labels()
            handles, labels = handles + more[0], labels + more[1]
        ax.legend(handles, labels)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    return out


def mark_spikes(ax, name: str, events: list[dict]) -> None:
    """Loss spikes on the loss panel: a cross per spike at its loss, a dashed line per rollback."""
    spiked = [e for e in events if e.get("spike_loss") is not None]
    if spiked:
        ax.plot(
            [e["step"] for e in spiked],
            [e["spike_loss"] for e in spiked],
            "x",
            color="red",
            label=f"{name} loss spikes",
        )
    for i, event in enumerate(e for e in events if e["event"] == "rollback"):
        ax.axvline(event["step"], color="red", linestyle="--", alpha=0.5, label=f"{name} rollbacks" if i == 0 else None)


def run(args: argparse.Namespace) -> int:
    out = draw(args.runs, args.out or default_out(args.runs))
    print(f"wrote {out}")
    return 0
