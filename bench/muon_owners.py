"""Muon against AdamW on gloo CPU ranks: per-rank peak RSS (``/usr/bin/time -f %M``) and step time, for the code
of one or more checkouts (``--code main=/work/main --code owners=.``: before and after a change).

Each run is ``--ranks`` processes of ``TrainModule.step`` on one repeated batch, ``--steps`` steps, the first
``--warmup`` untimed; each process is started under ``/usr/bin/time`` with ``PYTHONPATH`` at the checkout, so the
checkout's ``megatransformer`` is the one measured. Prints one row per run: the slowest rank's median step, the CPU
seconds of all ranks over the whole run (start-up included: on a loaded machine the steadier figure), the largest
peak RSS over the ranks, and the Newton-Schulz calls summed over the ranks (whole matrices, and team members' parts
of split ones).

    python bench/muon_owners.py --code main=/work/main --code owners=. --ranks 4 --zero 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODEL = {"d_model": 768, "n_layers": 8, "n_heads": 12, "n_kv_heads": 4, "d_ff": 2048, "vocab_size": 32000}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--code", action="append", default=[], help="NAME=PATH of a checkout (repeatable)")
    parser.add_argument("--optims", default="adamw,muon")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--zero", type=int, default=3)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--model", default=json.dumps(MODEL), help="the model section, as JSON")
    parser.add_argument("--worker", nargs=3, metavar=("RANK", "PORT", "OPTIM"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args: argparse.Namespace) -> None:
    """One rank: the trainer's step ``args.steps`` times; its step times and Newton-Schulz calls to ``args.out``."""
    import torch
    from gloo_ranks import join

    from megatransformer.config import RunConfig
    from megatransformer.training.checkpointing.checkpointer import innermost_optimizer
    from megatransformer.training.engine.train_module import TrainModule
    from megatransformer.training.runtime.distributed import teardown

    info = join(int(args.worker[0]), args.ranks, args.worker[1])
    optim = args.worker[2]
    model = {**json.loads(args.model), "max_seq_len": args.seq_len}
    cfg = RunConfig.model_validate(
        {
            "model": model,
            "data": {"seq_len": args.seq_len},
            "optim": {"name": optim},
            "parallel": {"zero_stage": args.zero},
            "train": {"micro_batch_size": 1},
            "precision": args.precision,
        }
    )
    module = TrainModule(cfg, info, zero_stage=args.zero)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg.model.vocab_size, (1, args.seq_len + 1), generator=gen)
    batch = {"input_ids": ids[:, :-1].contiguous(), "labels": ids[:, 1:].contiguous()}
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        module.step(iter([batch] * module.sizes.accum))
        times.append(time.perf_counter() - start)
    optimizer = innermost_optimizer(module.engine)
    calls, parts = getattr(optimizer, "ns_calls", 0), getattr(optimizer, "ns_parts", 0)
    module.close()
    teardown()
    Path(args.out).write_text(json.dumps({"times": times[args.warmup :], "ns_calls": calls, "ns_parts": parts}))


def run(args: argparse.Namespace, code: str, optim: str, work: Path) -> dict:
    """One run of ``args.ranks`` processes with ``code``'s megatransformer: its row."""
    from gloo_ranks import run_ranks

    passed = ["--ranks", str(args.ranks), "--zero", str(args.zero), "--precision", args.precision]
    passed += ["--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    ranks = run_ranks(__file__, code, args.ranks, work, [optim], [*passed, "--model", args.model])
    rss = [r.peak_rss_mib for r in ranks]
    return {
        "step_s": max(statistics.median(r.record["times"]) for r in ranks),
        "peak_rss_mib": max(rss),
        "rss_mib": rss,
        "ns_calls": sum(r.record["ns_calls"] for r in ranks),
        "ns_parts": sum(r.record.get("ns_parts", 0) for r in ranks),
        "cpu_s": sum(r.cpu_s for r in ranks),
    }


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    codes = dict(c.split("=", 1) for c in args.code) or {"here": "."}
    print(f"# {args.ranks} ranks, ZeRO-{args.zero}, {args.precision}, seq {args.seq_len}, model {args.model}")
    print(f"# load before: {os.getloadavg()}")
    columns = ["code", "optimizer", "step (s)", "CPU s, all ranks, whole run", "peak RSS per rank (MiB)", "NS calls"]
    print("| " + " | ".join(columns) + " |")
    print("|---|---|---|---|---|---|")
    for name, code in codes.items():
        for optim in args.optims.split(","):
            with tempfile.TemporaryDirectory() as work:
                row = run(args, code, optim, Path(work))
            rss = "/".join(f"{r:.0f}" for r in row["rss_mib"])
            cells = [name, optim, f"{row['step_s']:.2f}", f"{row['cpu_s']:.0f}", f"{row['peak_rss_mib']:.0f} ({rss})"]
            calls = f"{row['ns_calls']}" + (f" + {row['ns_parts']} team parts" if row["ns_parts"] else "")
            print("| " + " | ".join(cells + [calls]) + " |")
            sys.stdout.flush()
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
