"""The ZeRO-3 model build on gloo CPU ranks (``construction.build_for_run``: ``zero.Init`` and the initial values),
and init_from's load into it (``construction.load_into_partitioned`` from a weights checkpoint), for the code of one
or more checkouts (``--code before=/tmp/before --code after=.``: before and after a change).

Each run is ``--ranks`` processes; each builds the model once untimed (DeepSpeed's first-use work), then
``--builds`` times, each build timed and followed by a timed load of the weights checkpoint rank 0 wrote first.
Prints one row per checkout: the slowest rank's median build and load, and the CPU seconds of all ranks over the
whole run (start-up included).

    python bench/zero3_init.py --code before=/tmp/before --code after=. --ranks 4
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
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--builds", type=int, default=3)
    parser.add_argument("--model", default=json.dumps(MODEL), help="the model section, as JSON")
    parser.add_argument("--worker", nargs=2, metavar=("RANK", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    return parser.parse_args()


def worker(args: argparse.Namespace) -> None:
    """One rank: ``build_for_run`` at ZeRO-3, once untimed, then ``args.builds`` times; the times to ``args.out``."""
    import torch.distributed as dist
    from gloo_ranks import join

    from megatransformer.checkpoint import write_weights_checkpoint
    from megatransformer.checkpoint.files import LazyWeights
    from megatransformer.config import RunConfig
    from megatransformer.model import build_model
    from megatransformer.training.engine.construction import build_for_run, load_into_partitioned
    from megatransformer.training.engine.train_module import deepspeed_config
    from megatransformer.training.runtime.distributed import teardown
    from megatransformer.training.runtime.layout import BatchSizes

    info = join(int(args.worker[0]), args.ranks, args.worker[1])
    model = {**json.loads(args.model), "max_seq_len": 256}
    sections = {"model": model, "data": {"seq_len": 256}, "parallel": {"zero_stage": 3}, "precision": args.precision}
    cfg = RunConfig.model_validate(sections)
    ds = deepspeed_config(cfg, BatchSizes(1, 1, info.world_size), "cpu", zero_stage=3)
    weights = Path(args.out).parent / "weights"
    if info.rank == 0:
        write_weights_checkpoint(weights, cfg, build_model(cfg.model, cfg.seed).state_dict())
    build_for_run(cfg, 3, ds)
    builds, loads = [], []
    for _ in range(args.builds):
        dist.barrier()
        start = time.perf_counter()
        model = build_for_run(cfg, 3, ds)
        builds.append(time.perf_counter() - start)
        dist.barrier()
        start = time.perf_counter()
        load_into_partitioned(model, LazyWeights(weights))
        loads.append(time.perf_counter() - start)
    teardown()
    Path(args.out).write_text(json.dumps({"builds": builds, "loads": loads}))


def run(args: argparse.Namespace, code: str, work: Path) -> dict:
    """One run of ``args.ranks`` processes with ``code``'s megatransformer: its row."""
    from gloo_ranks import run_ranks

    passed = ["--ranks", str(args.ranks), "--precision", args.precision, "--builds", str(args.builds)]
    ranks = run_ranks(__file__, code, args.ranks, work, [], [*passed, "--model", args.model])
    slowest = {kind: max(statistics.median(r.record[kind]) for r in ranks) for kind in ("builds", "loads")}
    return {"build_s": slowest["builds"], "load_s": slowest["loads"], "cpu_s": sum(r.cpu_s for r in ranks)}


def main() -> None:
    args = parse_args()
    if args.worker:
        worker(args)
        return
    codes = dict(c.split("=", 1) for c in args.code) or {"here": "."}
    print(f"# {args.ranks} ranks, ZeRO-3, {args.precision}, model {args.model}")
    print(f"# load before: {os.getloadavg()}")
    print("| code | build (s), slowest rank's median | load (s), slowest rank's median | CPU s, all ranks, whole run |")
    print("|---|---|---|---|")
    for name, code in codes.items():
        with tempfile.TemporaryDirectory() as work:
            row = run(args, code, Path(work))
        print(f"| {name} | {row['build_s']:.2f} | {row['load_s']:.2f} | {row['cpu_s']:.0f} |")
        sys.stdout.flush()
    print(f"# load after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
