"""Wall time and steps to a target validation loss, per optimizer and schedule, each at its best of a learning-rate
sweep, side by side in one invocation (one run at a time unless --jobs, the same config, data, seed and batches).
A run already finished in --out (the same resolved config) is read instead of run again, so a sweep continues.

The target defaults to the best AdamW + cosine run's final validation loss; a run reaches it at the first validation
at or below it (so validate often: --evals). Wall time is the trainer's own clock from the start of its first step
(start-up excluded) to the end of that step, validation included, as every run validates equally often. Writes
OUT/curves.png (validation loss against wall time and against steps, the best run of each pair bold),
OUT/results.json and OUT/table.md. What the columns mean: docs/optimizers.md.

    python bench/time_to_loss.py --config configs/quickstart.yaml                 # the quickstart model
    python bench/time_to_loss.py --config configs/quickstart.yaml --steps 600 \\
        --pairs adamw:cosine,muon:wsd,adamw:wsd --out runs/time_to_loss
    python bench/time_to_loss.py --config /dev/null --steps 6 --evals 3 model.d_model=64 ...   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from megatransformer.config import load_config  # noqa: E402
from megatransformer.config.loading import dump_config  # noqa: E402

SWEEPS = {"adamw": "1e-3,2e-3,4e-3,8e-3", "muon": "0.005,0.01,0.02,0.04"}  # optim.lr / optim.muon_lr


@dataclass
class Run:
    optimizer: str
    schedule: str
    lr: float
    curve: list[tuple[int, float, float]]  # (step, wall seconds at the end of that step, validation loss)

    @property
    def pair(self) -> str:
        return f"{self.optimizer}+{self.schedule}"

    @property
    def final(self) -> float:
        return self.curve[-1][2]

    def reach(self, target: float) -> tuple[int, float] | None:
        """(steps, wall seconds) at the first validation at or below ``target``, or None."""
        return next(((step, wall) for step, wall, loss in self.curve if loss <= target), None)


def curve(run_dir: Path) -> list[tuple[int, float, float]]:
    """(step, wall seconds, validation loss) of each validation of a finished run, from its metrics.jsonl."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    train = {r["step"]: r for r in records if r["kind"] == "train"}
    if not train:
        return []
    first = train[min(train)]
    start = first["time"] - first["tokens"] / first["tokens_per_s"]  # the first step's own duration
    return [(r["step"], r["time"] - start, r["val_loss"]) for r in records if r["kind"] == "valid"]


def train(args: argparse.Namespace, optimizer: str, schedule: str, lr: float, threads: int | None = None) -> Run:
    """One run of the sweep; a finished run of the same resolved config in its directory is read, not run again."""
    run_dir, overrides = run_settings(args, optimizer, schedule, lr)
    if run_dir.exists():
        run = Run(optimizer, schedule, lr, finished_curve(run_dir, args.config, overrides, args.steps))
        print(f"  {run.pair:14} lr {lr:<8g} final validation loss {run.final:.4f} (finished before, read)", flush=True)
        return run
    command = [sys.executable, "-m", "megatransformer.cli", "train", "--config", args.config, *overrides]
    env = os.environ if threads is None else {**os.environ, "OMP_NUM_THREADS": str(threads)}
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise SystemExit(f"{' '.join(command)}\nexit {result.returncode}\n{result.stderr[-3000:]}")
    run = Run(optimizer, schedule, lr, curve(run_dir))
    print(f"  {run.pair:14} lr {lr:<8g} final validation loss {run.final:.4f} in {run.curve[-1][1]:.1f}s", flush=True)
    return run


def run_settings(args: argparse.Namespace, optimizer: str, schedule: str, lr: float) -> tuple[Path, list[str]]:
    """A run's directory and the overrides it trains with."""
    run_dir = Path(args.out) / f"{optimizer}-{schedule}-lr{lr:g}"
    lr_key = "optim.muon_lr" if optimizer == "muon" else "optim.lr"
    evals = max(1, args.steps // args.evals)
    overrides = [
        *args.overrides,
        f"run_dir={run_dir}",
        f"optim.name={optimizer}",
        f"{lr_key}={lr}",
        f"schedule.name={schedule}",
        f"train.max_steps={args.steps}",
        f"train.eval_every={evals}",
        f"checkpoint.every={args.steps}",
        "wandb.mode=disabled",
    ]
    if optimizer == "muon" and args.muon_adam_lr is not None:
        overrides.append(f"optim.lr={args.muon_adam_lr}")
    return run_dir, overrides


def finished_curve(run_dir: Path, config: str, overrides: list[str], steps: int) -> list[tuple[int, float, float]]:
    """The curve of a run that ``run_dir`` holds from an earlier invocation, if it is this run and it finished."""
    saved = run_dir / "config.yaml"
    if not saved.is_file() or saved.read_text() != dump_config(load_config(config, overrides)):
        raise SystemExit(f"{run_dir} holds another run (its config.yaml differs): choose another --out")
    points = curve(run_dir) if (run_dir / "metrics.jsonl").is_file() else []
    if not points or points[-1][0] != steps:
        raise SystemExit(f"{run_dir} holds an unfinished run: delete it to run it again")
    return points


def best_runs(runs: list[Run]) -> dict[str, Run]:
    """The run of each pair with the lowest final validation loss."""
    best: dict[str, Run] = {}
    for run in runs:
        if run.pair not in best or run.final < best[run.pair].final:
            best[run.pair] = run
    return best


def table(runs: list[Run], target: float, baseline: str) -> str:
    best = best_runs(runs)
    reference = best[baseline].reach(target)
    lines = [
        f"target: validation loss {target:.4f} (the best {baseline} run's final)",
        "",
        "| optimizer + schedule | best lr | final val loss | steps to target | wall s to target | x baseline's time |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    edges = False
    for pair, run in best.items():
        reached = run.reach(target)
        steps, wall = reached if reached else ("not reached", None)
        ratio = f"{wall / reference[1]:.2f}x" if reached and reference else "-"
        wall_text = f"{wall:.1f}" if wall is not None else "-"
        swept = [r.lr for r in runs if r.pair == pair]
        edge = run.lr in (min(swept), max(swept))
        edges = edges or edge
        lr = f"{run.lr:g}" + (" (edge)" if edge else "")
        lines.append(f"| {pair} | {lr} | {run.final:.4f} | {steps} | {wall_text} | {ratio} |")
    if edges:
        lines += [
            "",
            "(edge): the best rate is the sweep's smallest or largest; widen the sweep before reading its row",
        ]
    return "\n".join(lines)


def plot(runs: list[Run], target: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = best_runs(runs)
    colors = {pair: f"C{i}" for i, pair in enumerate(best)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for run in runs:
        steps, walls, losses = zip(*run.curve)
        bold = run is best[run.pair]
        style = {"color": colors[run.pair], "alpha": 1.0 if bold else 0.3, "linewidth": 2 if bold else 1}
        label = f"{run.pair} lr {run.lr:g}" if bold else None
        axes[0].plot(walls, losses, label=label, **style)
        axes[1].plot(steps, losses, **style)
    for ax, xlabel in zip(axes, ("wall time (s)", "step")):
        ax.axhline(target, color="gray", linestyle="--", linewidth=1)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("validation loss")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def sweep(args: argparse.Namespace, pairs: list[tuple[str, str]], lrs: dict[str, list[float]]) -> list[Run]:
    """Every rate of every pair, ``args.jobs`` runs at a time, each run given its share of the CPUs as threads."""
    todo = [(optimizer, schedule, lr) for optimizer, schedule in pairs for lr in lrs[optimizer]]
    if args.jobs == 1:
        return [train(args, *run) for run in todo]
    threads = max(1, len(os.sched_getaffinity(0)) // args.jobs)
    with ThreadPoolExecutor(args.jobs) as pool:
        return list(pool.map(lambda run: train(args, *run, threads=threads), todo))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the run's YAML (its model, data and batch)")
    parser.add_argument("--steps", type=int, default=300, help="train.max_steps of every run")
    parser.add_argument("--evals", type=int, default=20, help="validations per run (the target's resolution)")
    parser.add_argument("--pairs", default="adamw:cosine,muon:wsd", help="optimizer:schedule, comma-separated")
    parser.add_argument("--adamw-lrs", default=SWEEPS["adamw"], help="optim.lr values of AdamW runs")
    parser.add_argument("--muon-lrs", default=SWEEPS["muon"], help="optim.muon_lr values of Muon runs")
    parser.add_argument(
        "--muon-adam-lr",
        type=float,
        help="optim.lr of Muon runs' AdamW part (default: the best AdamW run's lr when AdamW pairs ran, which run "
        "first; else the config's)",
    )
    parser.add_argument("--target", type=float, help="validation loss to reach (default: the best baseline's final)")
    parser.add_argument("--baseline", default="adamw:cosine", help="the pair the target and the ratios refer to")
    parser.add_argument("--out", default="runs/time_to_loss", help="directory of the runs, the plot and the table")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="runs at a time, each with OMP_NUM_THREADS = CPUs / jobs (steps stay exact; wall times then include "
        "what the runs share, such as memory bandwidth)",
    )
    parser.add_argument("overrides", nargs="*", help="key.path=value overrides of every run")
    args = parser.parse_args()
    pairs = [tuple(p.split(":")) for p in args.pairs.split(",")]
    sweeps = {"adamw": args.adamw_lrs, "muon": args.muon_lrs}
    bad = [p for p in pairs if len(p) != 2 or p[0] not in sweeps]
    if bad or args.baseline.replace(":", "+") not in {f"{o}+{s}" for o, s in pairs if o in sweeps}:
        parser.error(f"--pairs {args.pairs} must be optimizer:schedule pairs (adamw or muon) including --baseline")
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: at least 1")
    sweeps = {optimizer: [float(x) for x in sweeps[optimizer].split(",")] for optimizer, _ in pairs}
    for optimizer, lrs in sweeps.items():
        if len(lrs) < 4:
            parser.error(f"--{optimizer}-lrs: a sweep of at least 4 learning rates, got {len(lrs)}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    adamw = [(o, s) for o, s in pairs if o == "adamw"]
    muon = [(o, s) for o, s in pairs if o == "muon"]
    if args.muon_adam_lr is None and adamw:  # Muon's AdamW part takes the best AdamW run's rate
        runs = sweep(args, adamw, sweeps)
        args.muon_adam_lr = min(runs, key=lambda r: r.final).lr
        print(f"  (Muon runs' AdamW part: optim.lr={args.muon_adam_lr:g}, the best AdamW run's)")
        runs += sweep(args, muon, sweeps)
    else:
        runs = sweep(args, adamw + muon, sweeps)
    baseline = args.baseline.replace(":", "+")
    target = args.target if args.target is not None else min(r.final for r in runs if r.pair == baseline)
    text = table(runs, target, baseline)
    print(text)
    out = Path(args.out)
    (out / "table.md").write_text(text + "\n")
    (out / "results.json").write_text(json.dumps({"target": target, "runs": [asdict(r) for r in runs]}, indent=1))
    plot(runs, target, out / "curves.png")
    print(f"wrote {out / 'table.md'}, {out / 'results.json'}, {out / 'curves.png'}")


if __name__ == "__main__":
    main()
