"""Each rank's peak resident memory over a whole short training run (start-up, the model's construction, one
step, the end), measured from outside: every torchrun rank runs under ``/usr/bin/time -f %M`` (torchrun
``--no-python`` with a wrapper that writes ``rss.$RANK``), and the same run of a tiny model (the process's own
cost) is subtracted (DESIGN.md section 14). The planner's figure for the layout (its largest moment, as ``plan``
reports it) is printed beside it, with the ratio. ``--host-memory keep,release`` runs the big model once per
``train.host_memory`` policy, alternating over ``--rounds``, and ``--steps`` above 1 adds the median seconds of the
steps after the first (from the run's metrics.jsonl), so a policy's memory and its step time are read side by side.

    OMP_NUM_THREADS=1 python bench/start_memory.py                  # 53.5M decoder, 4 ranks, ZeRO-3, bf16
    OMP_NUM_THREADS=1 python bench/start_memory.py --zero 1 --ranks 2
    OMP_NUM_THREADS=1 python bench/start_memory.py --host-memory keep,release --steps 6 --rounds 2

Memory is not load-sensitive: the numbers hold on a busy machine.
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

ROOT = Path(__file__).resolve().parent.parent
BIG = {"d_model": 768, "n_layers": 8, "n_heads": 12, "n_kv_heads": 4, "d_ff": 2048}
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "d_ff": 96}
VOCAB = 4096
WRAPPER = """#!/bin/sh
exec /usr/bin/time -f %M -o "{out}/rss.$RANK" "{python}" -m megatransformer.cli train --config /dev/null "$@"
"""


def make_data(root: Path) -> tuple[Path, Path]:
    from data_pipeline.corpus import write_demo_corpus
    from data_pipeline.shard import write_shards
    from data_pipeline.tokenizer import train_tokenizer

    corpus = write_demo_corpus(root / "corpus.txt", max_bytes=1_000_000)
    tokenizer = root / "tokenizer.json"
    train_tokenizer([str(corpus)], VOCAB, tokenizer)
    shards = root / "shards"
    write_shards([str(corpus)], str(tokenizer), shards, shard_mb=1, valid_every=50, workers=1, progress=False)
    return tokenizer, shards


def overrides(
    model: dict, data: tuple[Path, Path], run_dir: Path, zero: int, precision: str, steps: int = 1
) -> list[str]:
    tokenizer, shards = data
    return [
        *(f"model.{k}={v}" for k, v in (model | {"vocab_size": VOCAB, "max_seq_len": 128}).items()),
        f"data.train={shards}",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=128",
        "train.micro_batch_size=1",
        "train.grad_accum=1",
        f"train.max_steps={steps}",
        "train.log_every=1",
        "train.eval_every=0",
        "train.plot=false",
        "checkpoint.every=1000",
        "wandb.mode=disabled",
        f"precision={precision}",
        f"parallel.zero_stage={zero}",
        f"run_dir={run_dir}",
    ]


def torchrun(ranks: int) -> list[str]:
    """torchrun on this machine for ``ranks`` ranks, each running the command that follows (``--no-python``)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "--no-python"]


def peak_rss_mib(
    model: dict,
    data: tuple[Path, Path],
    root: Path,
    ranks: int,
    zero: int,
    precision: str,
    steps: int = 1,
    extra: tuple[str, ...] = (),
) -> tuple[list[float], float | None]:
    """Each rank's peak RSS (MiB) over the run, and the median seconds of its steps after the first (None for one
    step)."""
    out = Path(tempfile.mkdtemp(dir=root))
    wrapper = out / "rank.sh"
    wrapper.write_text(WRAPPER.format(out=out, python=sys.executable))
    wrapper.chmod(0o755)
    command = [
        *torchrun(ranks),
        str(wrapper),
        *overrides(model, data, out / "run", zero, precision, steps),
        *extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if done.returncode != 0:
        raise SystemExit(f"the run failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
    rss = [int((out / f"rss.{r}").read_text().split()[-1]) / 1024 for r in range(ranks)]
    return rss, median_step_seconds(out / "run" / "metrics.jsonl")


def median_step_seconds(metrics: Path) -> float | None:
    """The median seconds of the steps after the first: tokens between records over the record's rate."""
    rows = [r for r in map(json.loads, metrics.read_text().splitlines()) if "tokens_per_s" in r]
    seconds = [(r["tokens"] - prev["tokens"]) / r["tokens_per_s"] for prev, r in zip(rows, rows[1:])]
    return statistics.median(seconds) if seconds else None


def planned_mib(model: dict, ranks: int, zero: int, precision: str) -> tuple[float, str]:
    """The planner's figure per rank for the layout, as ``megatransformer plan`` and ``train.check_memory`` compare
    it with this machine's memory: the largest of its moments (construction, engine start, loading, the step; device
    and host together on a CPU), and which moment that is."""
    from megatransformer.commands.plan import config_layout
    from megatransformer.config import load_config
    from megatransformer.planner import cpu_device, memory_parts, peaks

    cfg = load_config(None, overrides(model, (Path("t"), Path("s")), Path("r"), zero, precision))
    device = cpu_device(ranks)
    layout, _ = config_layout(cfg, ranks, "cpu")
    moments = peaks(cfg, layout, device, memory_parts(cfg, layout, device))
    moment = max(moments, key=lambda name: moments[name].on(device))
    return moments[moment].on(device) / 2**20, moment


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--host-memory", default="", help="comma list of train.host_memory policies to compare")
    parser.add_argument("--rounds", type=int, default=1, help="runs of each policy, alternating")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    policies = [p for p in args.host_memory.split(",") if p] or [None]
    layout = (args.ranks, args.zero, args.precision, args.steps)
    results: dict[str | None, list[tuple[list[float], float | None]]] = {p: [] for p in policies}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_data(root)
        tiny, _ = peak_rss_mib(TINY, data, root, *layout)
        for round_ in range(args.rounds):
            for policy in policies if round_ % 2 == 0 else policies[::-1]:
                extra = (f"train.host_memory={policy}",) if policy else ()
                results[policy].append(peak_rss_mib(BIG, data, root, *layout, extra=extra))
    steps = "one step" if args.steps == 1 else f"{args.steps} steps"
    print(f"{args.ranks} ranks, ZeRO-{args.zero}, {args.precision}, d 768 x 8 layers (53.5M), {steps}")
    print("tiny model's run (MiB):     " + "  ".join(f"{v:7.0f}" for v in tiny))
    plan, moment = planned_mib(BIG, args.ranks, args.zero, args.precision)
    for policy, runs in results.items():
        for big, seconds in runs:
            above = [b - t for b, t in zip(big, tiny)]
            name = f"host_memory={policy}: " if policy else ""
            print(f"{name}peak RSS per rank (MiB):    " + "  ".join(f"{v:7.0f}" for v in big))
            print(f"{name}above the tiny run (MiB):   " + "  ".join(f"{v:7.0f}" for v in above), end="")
            print(f"   (largest {max(above):.0f}; / planner {max(above) / plan:.2f})", end="")
            print(f"   median step {seconds:.2f} s" if seconds is not None else "")
    print(f"planner (MiB):              {plan:7.0f}   ({moment})")


if __name__ == "__main__":
    main()
