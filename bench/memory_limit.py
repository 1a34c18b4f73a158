"""A model whose fp32 copy does not fit a rank's memory limit trains at ZeRO-3 and resumes on another layout.

Every torchrun rank imports what a training process imports, then joins a memory cgroup of its own whose limit
is ``--limit`` times the model's fp32 copy (4 bytes a parameter): from then on the kernel counts what the rank
touches (its pages, and the page cache it fills) and kills it past the limit, as Slurm's ``ConstrainRAMSpace``
does to a task. So no rank can ever hold the model whole in fp32, at construction, engine start, step,
checkpoint or load. Three runs, each rank under that limit:

  A  ``--ranks`` ranks, ZeRO-3, bf16, ``--steps`` steps, a checkpoint half-way and at the end;
  B  A's half-way checkpoint resumed on ``--resume-ranks`` ranks (another data-parallel size, the same global
     batch), to the same end: its losses must equal A's to rounding (the elastic resume tests' tolerance);
  T  a tiny model on A's layout: the process's own cost, printed beside the others.

Each rank's peak (the cgroup's ``max_usage_in_bytes``) is printed with the planner's largest moment for the
layout. Needs root and the cgroup v1 memory controller (``/sys/fs/cgroup/memory``); a quiet machine is not needed
(memory is not load-sensitive), but 16-20 ranks take ~12 GiB and several minutes of 2 cores.

    OMP_NUM_THREADS=1 python bench/memory_limit.py                  # 104M decoder, 16 -> 20 ranks, limit 0.9
    OMP_NUM_THREADS=1 python bench/memory_limit.py --limit 0.5      # expected to fail: the limit is too low
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from start_memory import make_data, torchrun

ROOT = Path(__file__).resolve().parent.parent
MODEL = {
    "d_model": 448,
    "n_layers": 40,
    "n_heads": 7,
    "n_kv_heads": 7,
    "d_ff": 1216,
}  # thin: one layer's buffers are small
TINY = {"d_model": 64, "n_layers": 2, "n_heads": 4, "n_kv_heads": 1, "d_ff": 96}
VOCAB, SEQ = 4096, 32
CGROUP_V1 = Path("/sys/fs/cgroup/memory")
RANK = """
import json, os, resource, sys
from pathlib import Path
import torch, torch._dynamo, deepspeed  # what every training rank imports before its model
import megatransformer.cli, megatransformer.training.engine.train_module
groups, out, limit, *args = sys.argv[1:]
group = Path(groups) / f"rank{os.environ['RANK']}"
group.mkdir()
(group / "memory.limit_in_bytes").write_text(limit)
(group / "cgroup.procs").write_text(str(os.getpid()))  # from here on, what this rank touches counts
status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
resident = int(status["VmRSS"].split()[0]) * 1024
code = megatransformer.cli.main(args)
peak = {
    "cgroup": int((group / "memory.max_usage_in_bytes").read_text()),
    "rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - resident,
}
(Path(out) / f"peak.{os.environ['RANK']}").write_text(json.dumps(peak))
megatransformer.cli.end_process(code)
"""


def own_memory_cgroup() -> Path:
    """This process's memory cgroup (v1), where the ranks' groups are made; exits in one line without it."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            group = CGROUP_V1 / path.lstrip("/")
            if os.access(group, os.W_OK):
                return group
    raise SystemExit("memory_limit: needs root and the cgroup v1 memory controller (/sys/fs/cgroup/memory)")


def overrides(model: dict, data: tuple[Path, Path], run_dir: Path, steps: int, batch: int) -> list[str]:
    tokenizer, shards = data
    return [
        *(f"model.{k}={v}" for k, v in (model | {"vocab_size": VOCAB, "max_seq_len": SEQ}).items()),
        f"data.train={shards}",
        f"data.tokenizer={tokenizer}",
        f"data.seq_len={SEQ}",
        f"data.streams={batch}",  # (dealt whole to the readers of both layouts)
        "train.micro_batch_size=1",
        f"train.global_batch_size={batch}",
        "train.grad_accum=null",
        "train.log_every=1",
        f"train.max_steps={steps}",
        f"checkpoint.every={max(steps // 2, 1)}",
        "train.plot=false",
        "wandb.mode=disabled",
        "precision=bf16",
        "parallel.zero_stage=3",
        "train.host_memory=release",  # (under keep the heap holds the step's fragmented peak: docs/architecture.md)
        f"run_dir={run_dir}",
    ]


def run_limited(ranks: int, limit: int, args: list[str], groups: Path, out: Path) -> list[dict[str, int]]:
    """One torchrun of ``ranks`` ranks, each in its own memory cgroup under ``groups`` limited to ``limit``
    bytes; each rank's peaks in bytes after it joined its group (written to ``out``): ``cgroup`` (what the limit
    counts: its pages and the page cache it filled) and ``rss`` (its resident memory)."""
    groups.mkdir()
    out.mkdir()
    command = [
        *torchrun(ranks),
        sys.executable,
        "-c",
        RANK,
        str(groups),
        str(out),
        str(limit),
        "train",
        "--config",
        "/dev/null",
        *args,
    ]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
        peaks = [json.loads(p.read_text()) for p in sorted(out.glob("peak.*"), key=lambda p: int(p.suffix[1:]))]
        failcnt = [int((g / "memory.failcnt").read_text()) for g in groups.glob("rank*")]
    finally:
        for group in groups.glob("rank*"):
            group.rmdir()
        groups.rmdir()
    if done.returncode != 0:
        oom = " (a rank hit its memory limit)" if any(failcnt) else ""
        log = Path(tempfile.gettempdir()) / "memory_limit-failed.log"
        log.write_text(f"{done.stdout}\n--- stderr\n{done.stderr}")
        raise SystemExit(f"the run failed{oom}; its output: {log}\n{done.stdout[-2000:]}")
    return peaks


def losses(run_dir: Path) -> dict[int, float]:
    rows = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["loss"] for row in rows if "loss" in row and row.get("kind") != "checkpoint"}


def planned_mib(model: dict, ranks: int, batch: int) -> tuple[float, str]:
    from megatransformer.commands.plan import config_layout
    from megatransformer.config import load_config
    from megatransformer.planner import cpu_device, memory_parts, peaks

    cfg = load_config(None, overrides(model, (Path("t"), Path("s")), Path("r"), 2, batch))
    device = cpu_device(ranks)
    layout, _ = config_layout(cfg, ranks, "cpu")
    moments = peaks(cfg, layout, device, memory_parts(cfg, layout, device))
    moment = max(moments, key=lambda name: moments[name].on(device))
    return moments[moment].on(device) / 2**20, moment


def parameters(model: dict) -> int:
    from megatransformer.config import load_config
    from megatransformer.planner import parameter_counts

    cfg = load_config(None, overrides(model, (Path("t"), Path("s")), Path("r"), 2, 1))
    return sum(parameter_counts(cfg.model))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=16)
    parser.add_argument("--resume-ranks", type=int, default=20)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--limit", type=float, default=0.9, help="each rank's limit, in fp32 copies of the model")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    groups = own_memory_cgroup()
    batch = math.lcm(args.ranks, args.resume_ranks)
    n = parameters(MODEL)
    limit = int(args.limit * 4 * n)
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        data = make_data(root)
        tag = f"mt-limit-{os.getpid()}"

        def run(name: str, ranks: int, limit: int, args: list[str]) -> list[dict[str, int]]:
            return run_limited(ranks, limit, args, groups / f"{tag}-{name}", root / f"peaks-{name}")

        first, second, half = root / "first", root / "resumed", args.steps // 2
        a = run("a", args.ranks, limit, overrides(MODEL, data, first, args.steps, batch))
        shutil.copytree(first / "checkpoints" / f"step_{half:06d}", root / "half")
        b = run(
            "b",
            args.resume_ranks,
            limit,
            [*overrides(MODEL, data, second, args.steps, batch), f"resume={root / 'half'}"],
        )
        tiny = run("t", args.ranks, 1 << 40, overrides(TINY, data, root / "tiny", 2, batch))
        reference, resumed = losses(first), losses(second)
    print(
        f"{n / 1e6:.1f}M decoder (d {MODEL['d_model']} x {MODEL['n_layers']}), ZeRO-3, bf16, global batch {batch} x "
        f"{SEQ}; fp32 copy {4 * n / mib:.0f} MiB; each rank's limit {limit / mib:.0f} MiB ({args.limit} copies)"
    )
    print("run  ranks  peak per rank after its imports, MiB: limited (with page cache) / resident   planner")

    def spread(peaks: list[dict[str, int]], kind: str) -> str:
        return f"{min(p[kind] for p in peaks) / mib:.0f}-{max(p[kind] for p in peaks) / mib:.0f}"

    for name, ranks, peaks in (("A", args.ranks, a), ("B", args.resume_ranks, b), ("tiny", args.ranks, tiny)):
        plan, moment = planned_mib(TINY if name == "tiny" else MODEL, ranks, batch)
        print(
            f"{name:4s} {ranks:5d}  {spread(peaks, 'cgroup'):>17s} / {spread(peaks, 'rss'):<30s} {plan:.0f} ({moment})"
        )
    steps = range(half + 1, args.steps + 1)
    print("step  loss A (uninterrupted)  loss B (resumed)  relative difference")
    for step in steps:
        difference = abs(resumed[step] - reference[step]) / abs(reference[step])
        print(f"{step:4d}  {reference[step]:22.6f}  {resumed[step]:16.6f}  {difference:.1e}")
    # The first resumed step agrees to rounding; later ones drift by the bf16 weights' rounding of updates summed
    # in another order (the elastic resume tests' tolerances, bf16's where they are fp32's).
    if sorted(resumed) != list(steps):
        raise SystemExit(f"the resumed run logged steps {sorted(resumed)}, not {list(steps)}")
    if abs(resumed[half + 1] - reference[half + 1]) > 1e-5 * abs(reference[half + 1]):
        raise SystemExit(
            f"the first resumed step's loss differs from A's: {resumed[half + 1]} != {reference[half + 1]}"
        )
    if any(abs(resumed[s] - reference[s]) > 1e-3 * abs(reference[s]) for s in steps):
        raise SystemExit("the resumed run drifts from A's losses by more than bf16's rounding")


if __name__ == "__main__":
    main()
