"""Our trainer against OLMo-core 3.0.0 on the same ~4.5M-parameter Llama-style model and tokens, at 1 and 2
intra-op threads, beside a known load: seconds per step and our speed relative to OLMo-core's.

Both sides are what a user runs, one process each:

  ours    ``megatransformer train`` end to end (the CLI in a fresh process, ZeRO-0, fp32), its threads forced to
          the count under test with OMP_NUM_THREADS; it chooses OpenMP's wait policy itself
          (training/threads.set_wait_policy: PASSIVE when other work takes cores). Step time: the wall time
          between consecutive records of its metrics.jsonl (``train.log_every=1``: tokens / tokens_per_s).
  olmo    OLMo-core's own ``Trainer`` and ``TransformerTrainModule`` built from their configs as its examples do
          (src/examples/llama/train.py: ``TransformerConfig.llama_like``, ``NumpyFSLDatasetConfig``,
          ``NumpyDataLoaderConfig``, ``TrainerConfig(...).build(...).fit()``), in the OLMo-core virtual
          environment's python (``--olmo-python``), a gloo group of one process, OMP_NUM_THREADS as ours and
          libgomp's default wait policy. Step time: the wall time between consecutive ``post_step`` callbacks.

A variant name may carry ``+passive`` or ``+active`` (OMP_WAIT_POLICY set for that process: ours leaves a
user's choice alone). The model: d_model 256, 4 layers, 4 heads (no GQA), SwiGLU d_ff 768 (OLMo-core's
``llama_like`` hidden size for d_model 256), RMSNorm eps 1e-5, RoPE theta 500,000, untied 2,048-token
vocabulary, no biases, fp32; micro batch 8 x 256 tokens, AdamW (lr 3e-3, betas 0.9/0.95, eps 1e-8, weight
decay 0.1, grad clip 1.0, cosine with 2 warmup steps), no compile, no checkpoints during the timed steps. The
tokens: the demo corpus (Python's docstrings) as one document, tokenized and sharded once in ``--work`` with our
CLI (so no window holds a document boundary: causal attention without document masks on both sides; ours picks
its CPU kernel, ``chunked``, OLMo-core torch's SDPA); OLMo-core reads exactly the rows our loader yields for those
steps, written as its flat uint16 token file.

Rounds alternate the variants (the order reversed every other round), so that the background load hits all
alike; the table gives each variant's median over rounds of its median seconds per step after ``--warmup``
steps, and the speed ratio ours / OLMo-core (OLMo-core's seconds over ours: above 1 we are faster) per thread
count, the range being the ratios of the single rounds. On a shared machine only the ratios mean anything, and
only for that load.

    /tmp/olmo-venv/bin/pip install ai2-olmo-core==3.0.0        # once: python -m venv --system-site-packages first
    python bench/olmo_core_side_by_side.py                        # 3 rounds, 1 and 2 threads, no load of ours
    python bench/olmo_core_side_by_side.py --background 8 --rounds 3 --json /tmp/sbs.json
    python bench/olmo_core_side_by_side.py --threads 2 --variants ours,olmo,olmo+passive

``--background K`` keeps K processes busy (bench/threads.py's ``busy_processes``) for the whole run.
``--count-regions`` adds, per variant, the OpenMP parallel regions a timed step opens and the seconds the opening
thread spends inside them (an LD_PRELOAD wrapper of libgomp's ``GOMP_parallel``, built with cc into
``--work``/regions; what a busy machine's idle-worker wait costs shows there).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent
OLMO_PYTHON = "/tmp/olmo-venv/bin/python"
INSTALL = "python -m venv --system-site-packages /tmp/olmo-venv && /tmp/olmo-venv/bin/pip install ai2-olmo-core==3.0.0"
WAIT_VARIABLES = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
MODEL = {  # the workload; OLMo-core's llama_like(d_model=256) resolves its SwiGLU hidden size to 768
    "d_model": 256,
    "layers": 4,
    "heads": 4,
    "d_ff": 768,
    "vocab": 2048,
    "seq": 256,
    "batch": 8,
    "rope_theta": 500_000,
    "lr": 3e-3,
    "warmup_lr_steps": 2,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--olmo-python",
        default=OLMO_PYTHON,
        help="a python that imports olmo_core 3.0.0",
    )
    p.add_argument(
        "--threads",
        default="1,2",
        help="comma list of intra-op thread counts (OMP_NUM_THREADS)",
    )
    p.add_argument(
        "--variants",
        default="ours,olmo",
        help="comma list of ours, olmo, each optionally +passive/+active",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3, help="steps left out of each run's median")
    p.add_argument("--steps", type=int, default=6, help="timed steps per run")
    p.add_argument(
        "--background",
        type=int,
        default=0,
        help="busy processes of other work beside the runs",
    )
    p.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/olmo-side-by-side"),
        help="data and run directories",
    )
    p.add_argument("--json", type=Path, help="write the results here too")
    p.add_argument(
        "--count-regions",
        action="store_true",
        help="count OpenMP parallel regions per step and the opening thread's seconds inside them (an "
        "LD_PRELOAD counter built with cc in --work; it adds a clock reading per region)",
    )
    p.add_argument("--olmo-child", help=argparse.SUPPRESS)  # (internal: one OLMo-core run, JSON arguments)
    args = p.parse_args(argv)
    if args.olmo_child is None:
        for variant in args.variants.split(","):
            name, _, policy = variant.partition("+")
            if name not in ("ours", "olmo") or policy not in ("", "passive", "active"):
                p.error(f"--variants: unknown {variant!r}; ours or olmo, optionally +passive or +active")
        if args.warmup < 1 or args.steps < 1 or args.rounds < 1:
            p.error("--warmup, --steps and --rounds must be >= 1")
    return args


# ------------------------------------------------------------------------------------------------ data


def cli(*words: str) -> list[str]:
    return [sys.executable, "-m", "megatransformer.cli", *words]


def child_env(threads: int, policy: str = "", regions: Path | None = None) -> dict[str, str]:
    """This checkout's code, DeepSpeed on the CPU, ``threads`` intra-op threads, no inherited wait policy;
    with ``regions``, the region counter (:data:`COUNTER`) writing to ``regions``.PID."""
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS=str(threads), PYTHONPATH=str(ROOT))
    if policy:
        env["OMP_WAIT_POLICY"] = policy.upper()
    if regions is not None:
        env.update(
            LD_PRELOAD=str(regions.parent / "gomp_regions.so"),
            GOMP_REGIONS_FILE=str(regions),
        )
    return env


def prepare_data(work: Path, batches: int) -> tuple[Path, Path, Path]:
    """``(shards, tokenizer, olmo_tokens)`` in ``work``, made once: the demo corpus as one train document and
    one validation document, and the first ``batches`` train batches of our loader as OLMo-core's token file."""
    shards, tokenizer = work / "shards", work / "tokenizer.json"
    tokens = work / f"olmo-tokens-{batches}x{MODEL['batch']}x{MODEL['seq']}.npy"
    if not (shards / "manifest.json").is_file():
        work.mkdir(parents=True, exist_ok=True)
        corpus = work / "corpus.txt"
        env = child_env(1)
        subprocess.run(
            cli("data", "demo-corpus", "--out", str(corpus)),
            env=env,
            check=True,
            capture_output=True,
        )
        text = corpus.read_text()
        cut = len(text) * 9 // 10  # (a file is a document below: document 0 trains, document 1 validates)
        (work / "a-train.txt").write_text(text[:cut])
        (work / "b-valid.txt").write_text(text[cut:])
        for words in (
            (
                "data",
                "tokenizer",
                "--input",
                str(corpus),
                "--vocab-size",
                str(MODEL["vocab"]),
                "--out",
                str(tokenizer),
            ),
            (
                "data",
                "shard",
                "--input",
                str(work / "a-train.txt"),
                str(work / "b-valid.txt"),
                "--tokenizer",
            )
            + (
                str(tokenizer),
                "--out",
                str(shards),
                "--doc-per",
                "file",
                "--valid-every",
                "2",
                "--overwrite",
            ),
        ):
            subprocess.run(cli(*words), env=env, check=True, capture_output=True)
    if not tokens.is_file():
        write_olmo_tokens(shards, tokenizer, tokens, batches)
    return shards, tokenizer, tokens


def write_olmo_tokens(shards: Path, tokenizer: Path, out: Path, batches: int) -> None:
    """The input rows of our loader's first ``batches`` batches, concatenated (OLMo-core's FSL dataset cuts the
    flat file into the same rows again)."""
    sys.path.insert(0, str(ROOT))
    import numpy as np

    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.config import load_config
    from megatransformer.training.data import build_run_loader

    cfg = load_config("quickstart", our_overrides(shards, tokenizer, out.parent / "unused", batches))
    loader = build_run_loader(cfg, "train", MODEL["batch"], 0, 1, load_tokenizer(str(tokenizer)))
    rows = []
    for batch in itertools.islice(iter(loader), batches):
        segments = batch["segment_ids"]
        assert bool((segments == segments[:, :1]).all()), "a window crosses a document boundary"
        rows.append(batch["input_ids"].numpy())
    np.concatenate(rows).astype(np.uint16).tofile(out)


# ------------------------------------------------------------------------------------------------ ours


def our_overrides(shards: Path, tokenizer: Path, run_dir: Path, steps: int) -> list[str]:
    m = MODEL
    return [
        f"run_dir={run_dir}",
        "precision=fp32",
        "parallel.zero_stage=0",
        f"model.d_model={m['d_model']}",
        f"model.n_layers={m['layers']}",
        f"model.n_heads={m['heads']}",
        f"model.n_kv_heads={m['heads']}",
        f"model.d_ff={m['d_ff']}",
        f"model.vocab_size={m['vocab']}",
        f"model.max_seq_len={m['seq']}",
        "model.tie_embeddings=false",
        f"model.rope_theta={m['rope_theta']}",
        "model.norm_eps=1e-5",
        f"data.train={shards}",
        f"data.tokenizer={tokenizer}",
        f"data.seq_len={m['seq']}",
        "data.streams=1",  # (one train document)
        f"train.max_steps={steps}",
        f"train.micro_batch_size={m['batch']}",
        "train.grad_accum=1",
        "train.grad_clip=1.0",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_prompt=null",
        "train.plot=false",
        f"optim.lr={m['lr']}",
        "optim.betas=[0.9,0.95]",
        "optim.eps=1e-8",
        "optim.weight_decay=0.1",
        "schedule.name=cosine",
        f"schedule.warmup_steps={m['warmup_lr_steps']}",
        "schedule.min_lr_ratio=0.1",
        "checkpoint.every=100000",
        "wandb.mode=disabled",
    ]


def run_ours(args: argparse.Namespace, data: tuple[Path, Path, Path], threads: int, policy: str) -> Steps:
    """Seconds of each step of one ``megatransformer train`` run, and when each ended."""
    shards, tokenizer, _ = data
    run_dir = args.work / "runs" / f"ours-{threads}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    steps = args.warmup + args.steps
    log = run_dir.with_suffix(".log")
    command = cli(
        "train",
        "--config",
        "quickstart",
        *our_overrides(shards, tokenizer, run_dir, steps),
    )
    with log.open("w") as out:
        env = child_env(threads, policy, regions_file(args, "ours", threads, policy))
        code = subprocess.run(command, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"ours: megatransformer train exited {code}; its output: {log}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    rows = [row for row in rows if row.get("kind") == "train"]
    if len(rows) != steps:
        raise SystemExit(f"ours: {len(rows)} train records in {run_dir}/metrics.jsonl, expected {steps}")
    before = [0] + [row["tokens"] for row in rows[:-1]]
    seconds = [(row["tokens"] - prev) / row["tokens_per_s"] for row, prev in zip(rows, before)]
    shutil.rmtree(run_dir)
    return Steps(seconds, [row["time"] for row in rows])


# ------------------------------------------------------------------------------------------------ OLMo-core


def run_olmo(args: argparse.Namespace, data: tuple[Path, Path, Path], threads: int, policy: str) -> Steps:
    """Seconds of each step of one OLMo-core run (this file's ``--olmo-child`` in the OLMo-core python), and
    when each ended."""
    _, _, tokens = data
    run_dir = args.work / "runs" / f"olmo-{threads}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    spec = {
        "tokens": str(tokens),
        "run_dir": str(run_dir),
        "steps": args.warmup + args.steps,
        **MODEL,
    }
    log = run_dir.with_suffix(".log")
    command = [
        args.olmo_python,
        str(Path(__file__).resolve()),
        "--olmo-child",
        json.dumps(spec),
    ]
    with log.open("w") as out:
        env = child_env(threads, policy, regions_file(args, "olmo", threads, policy))
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=out, text=True)
    if done.returncode != 0:
        raise SystemExit(f"olmo: exited {done.returncode}; its output: {log}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if result["threads"] != threads:
        raise SystemExit(f"olmo: ran {result['threads']} threads, not {threads}")
    shutil.rmtree(run_dir)
    return Steps(result["seconds"], result["ends"])


def olmo_child(spec: dict) -> None:
    """One OLMo-core run as its examples build one; prints the seconds of each step as a JSON line."""
    import torch
    from olmo_core.data import (
        NumpyDataLoaderConfig,
        NumpyFSLDatasetConfig,
        TokenizerConfig,
    )
    from olmo_core.nn.transformer import TransformerConfig
    from olmo_core.optim import AdamWConfig, CosWithWarmup
    from olmo_core.train import (
        Duration,
        TrainerConfig,
        prepare_training_environment,
        teardown_training_environment,
    )
    from olmo_core.train.callbacks import Callback
    from olmo_core.train.train_module import TransformerTrainModuleConfig
    from olmo_core.utils import seed_all

    class StepTimes(Callback):
        """The wall time from the end of one step (or the start of training) to the end of the next."""

        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.ends: list[float] = []  # (the epoch, as our metrics.jsonl's "time")
            self.last = 0.0

        def pre_train(self) -> None:
            self.last = time.perf_counter()

        def post_step(self) -> None:
            now = time.perf_counter()
            self.seconds.append(now - self.last)
            self.ends.append(time.time())
            self.last = now

    prepare_training_environment(backend="gloo")  # (its default also sets a CUDA device)
    try:
        seed_all(0)
        tokenizer = TokenizerConfig(vocab_size=spec["vocab"], eos_token_id=2, pad_token_id=0)
        model_config = TransformerConfig.llama_like(
            d_model=spec["d_model"],
            vocab_size=spec["vocab"],
            n_layers=spec["layers"],
            n_heads=spec["heads"],
            rope_theta=spec["rope_theta"],
        )
        assert model_config.block.feed_forward.hidden_size == spec["d_ff"], model_config.block.feed_forward
        model = model_config.build(init_device="meta")
        tokens = spec["seq"] * spec["batch"]
        train_module = TransformerTrainModuleConfig(
            rank_microbatch_size=tokens,
            max_sequence_length=spec["seq"],
            optim=AdamWConfig(lr=spec["lr"], betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1),
            max_grad_norm=1.0,
            scheduler=CosWithWarmup(warmup=spec["warmup_lr_steps"], alpha_f=0.1),
        ).build(model, device=torch.device("cpu"))
        work = str(Path(spec["run_dir"]) / "work")
        dataset = NumpyFSLDatasetConfig(
            paths=[spec["tokens"]],
            sequence_length=spec["seq"],
            tokenizer=tokenizer,
            work_dir=work,
        ).build()
        data_loader = NumpyDataLoaderConfig(global_batch_size=tokens, seed=0, num_workers=0, work_dir=work).build(
            dataset, dp_process_group=train_module.dp_process_group
        )
        timer = StepTimes()
        trainer = (
            TrainerConfig(
                save_folder=spec["run_dir"],
                save_overwrite=True,
                max_duration=Duration.steps(spec["steps"]),
                metrics_collect_interval=1,  # (ours logs every step too)
                device="cpu",
                no_checkpoints=True,
                no_evals=True,
            )
            .with_callback("step_times", timer)
            .build(train_module, data_loader)
        )
        trainer.fit()
        print(
            json.dumps(
                {
                    "threads": torch.get_num_threads(),
                    "seconds": timer.seconds,
                    "ends": timer.ends,
                }
            ),
            flush=True,
        )
    finally:
        teardown_training_environment()


# ------------------------------------------------------------------------------------------------ regions

COUNTER = r"""
// LD_PRELOAD: counts libgomp's parallel regions (GOMP_parallel, what ATen's parallel_for opens) and the wall time
// the opening thread spends in them (its share of the work, then waiting for the team); every 16 regions appends
// "epoch_seconds regions nanoseconds_inside" to $GOMP_REGIONS_FILE.<pid>.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
static void (*real)(void (*)(void *), void *, unsigned, unsigned);
static unsigned long long regions, inside;
static FILE *out;
static unsigned long long ns(clockid_t clock) {
  struct timespec t;
  clock_gettime(clock, &t);
  return t.tv_sec * 1000000000ull + t.tv_nsec;
}
void GOMP_parallel(void (*fn)(void *), void *data, unsigned n, unsigned flags) {
  if (!real) real = dlsym(RTLD_NEXT, "GOMP_parallel");
  unsigned long long start = ns(CLOCK_MONOTONIC);
  real(fn, data, n, flags);
  unsigned long long total = __atomic_add_fetch(&inside, ns(CLOCK_MONOTONIC) - start, __ATOMIC_RELAXED);
  unsigned long long count = __atomic_add_fetch(&regions, 1, __ATOMIC_RELAXED);
  if (count % 16) return;
  if (!out) {
    char name[4096];
    snprintf(name, sizeof name, "%s.%d", getenv("GOMP_REGIONS_FILE"), getpid());
    out = fopen(name, "a");
  }
  if (out) {
    fprintf(out, "%.4f %llu %llu\n", ns(CLOCK_REALTIME) * 1e-9, count, total);
    fflush(out);
  }
}
"""


class Steps(NamedTuple):
    seconds: list[float]  # each step's wall time
    ends: list[float]  # when each ended (epoch seconds)


def build_counter(work: Path) -> None:
    """Compiles :data:`COUNTER` into ``work``/regions/gomp_regions.so (needs a C compiler)."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("--count-regions needs a C compiler (cc or gcc) to build its LD_PRELOAD counter")
    (work / "regions").mkdir(parents=True, exist_ok=True)
    source = work / "regions" / "gomp_regions.c"
    source.write_text(COUNTER)
    so = work / "regions" / "gomp_regions.so"
    subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-o", str(so), str(source), "-ldl"], check=True)


def regions_file(args: argparse.Namespace, name: str, threads: int, policy: str) -> Path | None:
    """Where a run's region counts go (its old ones removed), or None without --count-regions."""
    if not args.count_regions:
        return None
    base = args.work / "regions" / f"{name}{'+' + policy if policy else ''}-{threads}"
    base.parent.mkdir(parents=True, exist_ok=True)
    for old in base.parent.glob(base.name + ".*"):
        old.unlink()
    return base


def regions_per_step(base: Path, steps: Steps, warmup: int) -> tuple[float, float]:
    """(regions, seconds inside them) per timed step of the run whose counts are in ``base``.PID: the process
    that opened the most regions, its counts at the ends of the warm-up and of the last step (to 16 regions).
    None opened at all (no file) at one thread: ATen runs a parallel_for inline when it has one thread."""
    readings = max(
        (
            [tuple(map(float, line.split())) for line in path.read_text().splitlines() if line]
            for path in base.parent.glob(base.name + ".*")
        ),
        key=len,
        default=[],
    )

    def at(when: float) -> tuple[float, float]:
        before = [r for r in readings if r[0] <= when]
        return (before[-1][1], before[-1][2] / 1e9) if before else (0.0, 0.0)

    (r0, s0), (r1, s1) = at(steps.ends[warmup - 1]), at(steps.ends[-1])
    timed = len(steps.ends) - warmup
    return (r1 - r0) / timed, (s1 - s0) / timed


# ------------------------------------------------------------------------------------------------ rounds


def check_olmo_python(python: str) -> tuple[str, str]:
    """(OLMo-core's version, torch's) in ``python``; exits in one line naming the install when it has none."""
    probe = "import olmo_core.version as v, torch; print(v.VERSION, torch.__version__)"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=120)
    except OSError:
        done = None
    if done is None or done.returncode != 0:
        raise SystemExit(f"{python} cannot import olmo_core; install OLMo-core 3.0.0 there: {INSTALL}")
    version, torch_version = done.stdout.split()
    if version != "3.0.0":
        print(f"warning: {python} has OLMo-core {version}, not 3.0.0", file=sys.stderr)
    return version, torch_version


def wait_policy_ours_picks() -> bool:
    """Whether the CLI would set OMP_WAIT_POLICY=PASSIVE now (its own reading of the load)."""
    sys.path.insert(0, str(ROOT))
    from megatransformer.training.threads import set_wait_policy

    return set_wait_policy(environ={})


def run_rounds(args: argparse.Namespace, data: tuple[Path, Path, Path]) -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    from threads import (
        busy_processes,
    )  # (bench/threads.py: K processes spinning on a core each)

    threads = [int(t) for t in args.threads.split(",")]
    keys = [(t, v) for t in threads for v in args.variants.split(",")]
    seconds = {key: [] for key in keys}
    regions = {key: [] for key in keys}  # (regions, seconds inside them) per timed step, each round
    loads, passive = [], []
    with busy_processes(args.background):
        time.sleep(2 if args.background else 0)  # (the spinners start before the first round's reading)
        for round_ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            passive.append(wait_policy_ours_picks())
            for t, variant in keys if round_ % 2 == 0 else keys[::-1]:
                name, _, policy = variant.partition("+")
                steps = (run_ours if name == "ours" else run_olmo)(args, data, t, policy)
                seconds[(t, variant)].append(statistics.median(steps.seconds[args.warmup :]))
                counted = ""
                if args.count_regions:
                    regions[(t, variant)].append(
                        regions_per_step(args.work / "regions" / f"{variant}-{t}", steps, args.warmup)
                    )
                    count, inside = regions[(t, variant)][-1]
                    counted = f" | {count:.0f} regions/step, {inside:.3f} s/step inside them"
                print(
                    f"# round {round_ + 1} threads {t} {variant}: "
                    + " ".join(f"{s:.3f}" for s in steps.seconds)
                    + f" s (median after warm-up {seconds[(t, variant)][-1]:.3f}){counted}",
                    flush=True,
                )
            loads.append(os.getloadavg()[0])
    return {
        "seconds": seconds,
        "regions": regions,
        "loads": loads,
        "passive": passive,
        "threads": threads,
    }


def summary(args: argparse.Namespace, result: dict) -> list[dict]:
    """A row per thread count and variant: its median over rounds, and for ours, its speed relative to each
    OLMo-core variant (their median seconds over ours) with the range of the single rounds' ratios."""
    variants = args.variants.split(",")
    bases = [v for v in variants if v.startswith("olmo")]
    rows = []
    for t in result["threads"]:
        for variant in variants:
            per_round = result["seconds"][(t, variant)]
            row = {
                "threads": t,
                "variant": variant,
                "seconds": statistics.median(per_round),
                "rounds": per_round,
            }
            if result["regions"][(t, variant)]:
                counts, inside = zip(*result["regions"][(t, variant)])
                row["regions_per_step"], row["seconds_inside_regions"] = (
                    statistics.median(counts),
                    statistics.median(inside),
                )
            if variant.startswith("ours"):
                row["speed_vs"] = {}
                for base in bases:
                    theirs = result["seconds"][(t, base)]
                    ratios = [o / s for o, s in zip(theirs, per_round)]
                    row["speed_vs"][base] = {
                        "median": statistics.median(theirs) / row["seconds"],
                        "rounds": ratios,
                    }
            rows.append(row)
    return rows


def markdown(rows: list[dict], bases: list[str]) -> str:
    counted = any("regions_per_step" in row for row in rows)
    head = "".join(f" speed vs {b} (rounds' range) |" for b in bases)
    head += " OpenMP regions/step | s/step inside them |" if counted else ""
    width = 4 + len(bases) + 2 * counted
    lines = [f"| threads | variant | s/step (median of rounds) | rounds |{head}", "|" + "---|" * width]
    for row in rows:
        cells = ""
        for base in bases:
            ratio = row.get("speed_vs", {}).get(base)
            r = ratio["rounds"] if ratio else []
            cells += f" {ratio['median']:.2f}x ({min(r):.2f}-{max(r):.2f}) |" if ratio else " - |"
        if counted:
            cells += f" {row.get('regions_per_step', 0):.0f} | {row.get('seconds_inside_regions', 0):.3f} |"
        rounds = " ".join(f"{s:.3f}" for s in row["rounds"])
        lines.append(f"| {row['threads']} | {row['variant']} | {row['seconds']:.3f} | {rounds} |{cells}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.olmo_child is not None:
        olmo_child(json.loads(args.olmo_child))
        return 0
    if any(v.startswith("olmo") for v in args.variants.split(",")):
        olmo_version, torch_version = check_olmo_python(args.olmo_python)
    else:
        olmo_version = torch_version = None
    data = prepare_data(args.work, args.warmup + args.steps)
    if args.count_regions:
        build_counter(args.work)
    started = datetime.datetime.now(datetime.timezone.utc)
    result = run_rounds(args, data)
    rows = summary(args, result)
    loads = result["loads"]
    facts = {
        "started_utc": started.isoformat(timespec="seconds"),
        "minutes": round(
            (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds() / 60,
            1,
        ),
        "cpu": platform.processor() or platform.machine(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "background": args.background,
        "load_average": [round(x, 2) for x in loads],
        "ours_wait_policy_passive_at_round_start": result["passive"],
        "olmo_core": olmo_version,
        "torch_in_olmo_python": torch_version,
        "model": MODEL,
        "warmup": args.warmup,
        "steps": args.steps,
        "rounds": args.rounds,
    }
    print(
        f"{facts['cores_usable']} usable cores, {args.background} busy processes of ours beside the runs, 1-minute "
        f"load average at the rounds' starts and ends {min(loads):.1f}-{max(loads):.1f}; ours picked "
        f"OMP_WAIT_POLICY=PASSIVE at {sum(result['passive'])} of {len(result['passive'])} round starts"
    )
    print(markdown(rows, [v for v in args.variants.split(",") if v.startswith("olmo")]))
    if args.json:
        args.json.write_text(json.dumps({"facts": facts, "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
