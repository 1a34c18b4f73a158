"""The trainer end to end, side by side with the bare model step and a plain transformers loop.

What each runner measures and how rounds are timed: docs/benchmarks.md.

    python bench/end_to_end.py                                  # bf16, the llama-style workload
    python bench/end_to_end.py --precision bf16,fp32 --rounds 5 --steps 6 --profile
    python bench/end_to_end.py --family gpt2 --d-model 256 --layers 4 --heads 8 --ffn 1024 --batch 8 \
        --seq 256 --precision fp32                              # the small GPT-2-style model
    python bench/end_to_end.py --d-model 64 --layers 2 --heads 2 --kv-heads 1 --ffn 128 --seq 64 --batch 2 \\
        --rounds 1 --steps 3                                    # a smoke run
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime
import importlib.metadata
import inspect
import json
import os
import platform
import pstats
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import train_step  # noqa: E402

from megatransformer.config import RunConfig, load_config  # noqa: E402
from megatransformer.training.runtime.cpu_bf16 import native_bf16_gemm  # noqa: E402

CONFIG = "llama-style"
PRECISIONS = ("bf16", "fp32")
# runner -> (ZeRO stage, host memory policy, train.cpu_bf16_matmul)
TRAINERS = {
    "trainer-z0": (0, "keep", "auto"),
    "trainer-z1": (1, "keep", "auto"),
    "trainer-release": (0, "release", "auto"),
    "trainer-native": (0, "keep", "native"),
}
# runner -> (host memory policy of its process, None for the C library's defaults; how its bf16 GEMMs run on a CPU)
WORKERS = {"bare": ("keep", "auto"), "hf": (None, "native"), "hf-keep": ("keep", "auto")}
RUNNERS = (*TRAINERS, *WORKERS)
DEFAULT_RUNNERS = ("trainer-z0", "trainer-release", "bare", "hf", "hf-keep")
# the model family's overrides of the llama-style config (gpt2: the small GPT-2-style model, whose
# plain loop is transformers' GPT2LMHeadModel)
FAMILIES = {
    "llama": [],
    "gpt2": ["model.norm=layernorm", "model.position=learned", "model.ffn=gelu", "model.bias=true"],
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatransformer.cli import HelpFormatter

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
    train_step.add_model_args(p)
    p.set_defaults(vocab=2048)
    p.add_argument(
        "--family",
        choices=tuple(FAMILIES),
        default="llama",
        help="llama: RMSNorm, RoPE, GQA, SwiGLU; gpt2: LayerNorm, learned positions, GELU, biases, "
        "tied embeddings, no GQA (the plain loop is GPT2LMHeadModel)",
    )
    p.add_argument("--precision", default="bf16", help=f"comma list of {PRECISIONS}")
    p.add_argument("--runners", default=",".join(DEFAULT_RUNNERS), help=f"comma list of {RUNNERS}")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds (0: only --profile)")
    p.add_argument("--steps", type=int, default=6, help="timed steps per runner and round")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before them, in every process")
    p.add_argument("--work", type=Path, default=Path("/tmp/mt-e2e"), help="data (prepared once) and run dirs")
    p.add_argument("--shards", type=Path, help="use these shards instead of preparing them in --work")
    p.add_argument("--tokenizer", type=Path, help="the tokenizer.json of --shards")
    p.add_argument("--threads", type=int, help="OMP_NUM_THREADS of every runner (default: torch's own)")
    p.add_argument("--profile", action="store_true", help="then cProfile one trainer run: where its time goes")
    p.add_argument(
        "--profile-runner",
        choices=tuple(TRAINERS),
        default="trainer-z1",
        help="the trainer --profile runs (in the first --precision)",
    )
    p.add_argument("--worker", choices=tuple(WORKERS), help=argparse.SUPPRESS)  # one runner, one JSON line
    args = p.parse_args(argv)
    for name, allowed in (("precision", PRECISIONS), ("runners", RUNNERS)):
        bad = [x for x in getattr(args, name).split(",") if x not in allowed]
        if bad:
            p.error(f"--{name}: unknown {bad}; choose from {allowed}")
    if args.family == "gpt2":
        args.tie, args.kv_heads = True, args.heads  # (what GPT2LMHeadModel is)
    if (args.shards is None) != (args.tokenizer is None):
        p.error("--shards and --tokenizer go together (the tokenizer the shards were made with)")
    if args.steps < 1 or args.warmup < 0 or args.rounds < 0:
        p.error("--steps must be >= 1, --warmup and --rounds >= 0")
    return args


# ------------------------------------------------------------------------------------------ data and config


def subprocess_env(args: argparse.Namespace) -> dict[str, str]:
    """This checkout's code, DeepSpeed on the CPU, and the same thread count in every runner."""
    env = dict(
        os.environ,
        DS_ACCELERATOR="cpu",
        PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def megatransformer_command(*words: str) -> list[str]:
    return [sys.executable, "-m", "megatransformer.cli", *words]


def prepare_data(args: argparse.Namespace) -> tuple[Path, Path]:
    """``(shards, tokenizer)``: the given ones, or a demo corpus sharded once in ``--work`` with the CLI."""
    if args.shards is not None:
        return args.shards, args.tokenizer
    work = args.work
    shards, tokenizer, corpus = work / "shards", work / "tokenizer.json", work / "corpus.txt"
    if (shards / "manifest.json").is_file():  # (the manifest is written last: the set is complete)
        return shards, tokenizer
    work.mkdir(parents=True, exist_ok=True)
    print(f"# preparing shards in {work} (once)", flush=True)
    for words in (
        ("data", "demo-corpus", "--out", str(corpus)),
        ("data", "tokenizer", "--input", str(corpus), "--vocab-size", str(args.vocab), "--out", str(tokenizer)),
        ("data", "shard", "--input", str(corpus), "--tokenizer", str(tokenizer), "--out", str(shards), "--overwrite"),
    ):
        subprocess.run(megatransformer_command(*words), env=subprocess_env(args), check=True, stdout=subprocess.DEVNULL)
    return shards, tokenizer


def overrides(
    args: argparse.Namespace,
    precision: str,
    zero_stage: int,
    run_dir: Path,
    shards: Path,
    tokenizer: Path,
    host_memory: str = "keep",
    cpu_bf16_matmul: str = "auto",
) -> list[str]:
    """The trainer's command-line overrides of the llama-style config: the workload, one log line per step."""
    steps = args.warmup + args.steps
    return [
        f"run_dir={run_dir}",
        f"precision={precision}",
        f"parallel.zero_stage={zero_stage}",
        f"train.host_memory={host_memory}",
        f"train.cpu_bf16_matmul={cpu_bf16_matmul}",
        f"model.d_model={args.d_model}",
        f"model.n_layers={args.layers}",
        f"model.n_heads={args.heads}",
        f"model.n_kv_heads={args.kv_heads}",
        f"model.d_ff={args.ffn}",
        f"model.vocab_size={args.vocab}",
        f"model.max_seq_len={args.seq}",
        f"model.tie_embeddings={str(args.tie).lower()}",
        f"data.train={shards}",
        f"data.tokenizer={tokenizer}",
        f"data.seq_len={args.seq}",
        "data.streams=4",
        f"train.max_steps={steps}",
        f"train.micro_batch_size={args.batch}",
        "train.global_batch_size=null",
        "train.grad_accum=1",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        f"checkpoint.every={steps}",
        "wandb.mode=disabled",
        *FAMILIES[args.family],
    ]


# ------------------------------------------------------------------------------------------ the runners


def trainer_rate(args: argparse.Namespace, runner: str, precision: str, shards: Path, tokenizer: Path) -> float:
    """Tokens/s of ``megatransformer train`` over its logged windows after the warm-up steps."""
    run_dir = args.work / "runs" / f"{runner}-{precision}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    zero_stage, host_memory, cpu_bf16_matmul = TRAINERS[runner]
    command = megatransformer_command(
        "train",
        "--config",
        CONFIG,
        *overrides(args, precision, zero_stage, run_dir, shards, tokenizer, host_memory, cpu_bf16_matmul),
    )
    log = run_dir.with_suffix(".log")
    with log.open("w") as out:
        code = subprocess.run(command, env=subprocess_env(args), stdout=out, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(
            f"{runner} {precision}: megatransformer train exited {code}; its output: {log}\n"
            + "".join(log.read_text().splitlines(keepends=True)[-15:])
        )
    rows = [
        json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"tokens_per_s"' in line
    ]
    shutil.rmtree(run_dir / "checkpoints")  # (hundreds of MB per round at the full size)
    if len(rows) != args.warmup + args.steps:
        raise SystemExit(
            f"{runner} {precision}: {len(rows)} logged steps in {run_dir}/metrics.jsonl, expected "
            f"{args.warmup + args.steps}"
        )
    before = rows[args.warmup - 1]["tokens"] if args.warmup else 0
    tokens = rows[-1]["tokens"] - before
    seconds = sum(
        (row["tokens"] - prev) / row["tokens_per_s"]
        for row, prev in zip(rows[args.warmup :], [before] + [r["tokens"] for r in rows[args.warmup : -1]])
    )
    return tokens / seconds


def worker_rate(args: argparse.Namespace, runner: str, precision: str, shards: Path, tokenizer: Path) -> float:
    """Tokens/s of the bare or an hf runner, run in a fresh process (``--worker``)."""
    command = [
        sys.executable,
        __file__,
        "--worker",
        runner,
        "--precision",
        precision,
        "--shards",
        str(shards),
        "--tokenizer",
        str(tokenizer),
        "--work",
        str(args.work),
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--family",
        args.family,
        "--d-model",
        str(args.d_model),
        "--layers",
        str(args.layers),
        "--heads",
        str(args.heads),
        "--kv-heads",
        str(args.kv_heads),
        "--ffn",
        str(args.ffn),
        "--vocab",
        str(args.vocab),
        "--batch",
        str(args.batch),
        "--seq",
        str(args.seq),
    ]
    if args.tie:
        command.append("--tie")
    done = subprocess.run(command, env=subprocess_env(args), capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{runner} {precision}: the worker exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])["tokens_per_s"]


def run_config(args: argparse.Namespace, precision: str) -> RunConfig:
    """The trainer's RunConfig (its zero stage and run dir do not matter to the bare and hf runners)."""
    return load_config(
        CONFIG, overrides(args, precision, 0, args.work / "runs" / "unused", args.shards, args.tokenizer)
    )


def worker(args: argparse.Namespace) -> int:
    """One bare or hf runner: ``--warmup`` steps, then ``--steps`` timed ones; prints one JSON line."""
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.model import build_model
    from megatransformer.training.data import build_run_loader
    from megatransformer.training.runtime.host_memory import apply_host_memory_policy
    from megatransformer.training.runtime.layout import resolve_batch_sizes

    host_memory, cpu_bf16_matmul = WORKERS[args.worker]
    if host_memory is not None:
        apply_host_memory_policy(host_memory)
    precision = args.precision
    cfg = run_config(args, precision)
    torch.manual_seed(cfg.seed)  # the trainer's initial weights
    model = build_model(cfg.model)
    micro = resolve_batch_sizes(cfg.train, 1).micro
    batches = iter(build_run_loader(cfg, "train", micro, 0, 1, load_tokenizer(cfg.data.tokenizer)))
    if args.worker == "bare":
        o = cfg.optim
        adamw = {"lr": o.lr, "betas": tuple(o.betas), "eps": o.eps, "weight_decay": o.weight_decay, "fused": True}
        runner = train_step.Runner("ours", model, precision, "cpu", False, adamw, cpu_bf16_matmul)
        step = bare_step(runner, batches, cfg)
    else:
        mode = "autocast" if precision == "bf16" else "fp32"
        runner = train_step.hf_runner(cfg.model, model.state_dict(), mode, "cpu", False, cpu_bf16_matmul)
        step = hf_step(runner, batches)
        del model
    for _ in range(args.warmup):
        step()
    tokens, start = 0, time.perf_counter()
    for _ in range(args.steps):
        tokens += step()
    seconds = time.perf_counter() - start
    print(
        json.dumps(
            {
                "runner": args.worker,
                "precision": precision,
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": tokens / seconds,
                "threads": torch.get_num_threads(),
            }
        )
    )
    return 0


def bare_step(runner: train_step.Runner, batches: Iterator[dict], cfg: RunConfig) -> Callable[[], int]:
    """A step as the engine feeds the model (``engine.batch_to_device``: the loader's batch on the device, its
    masks built on the host once), without DeepSpeed around the model. Returns the positions it trained on."""
    from megatransformer.training.engine.train_module import batch_to_device

    device = torch.device(runner.device)

    def step() -> int:
        inputs, labels, masks = batch_to_device(next(batches), device, cfg.model.arch)
        input_ids = inputs.pop("input_ids")
        runner.step(input_ids, labels, **inputs, masks=masks)
        return input_ids.numel()

    return step


def hf_step(runner: train_step.Runner, batches: Iterator[dict]) -> Callable[[], int]:
    """A plain transformers loop's step: token ids and labels only (no document masks, positions 0..T-1)."""

    def step() -> int:
        batch = next(batches)
        runner.step(batch["input_ids"], batch["labels"])
        return batch["input_ids"].numel()

    return step


# ------------------------------------------------------------------------------------------ the rotation


def run_rounds(args: argparse.Namespace, shards: Path, tokenizer: Path) -> dict[tuple[str, str], list[float]]:
    """Tokens/s per round of every (precision, runner), in one rotation (reversed on odd rounds)."""
    keys = [(p, r) for p in args.precision.split(",") for r in args.runners.split(",")]
    rates: dict[tuple[str, str], list[float]] = {key: [] for key in keys}
    # The first process after a pause ran 20-40% slow in two runs here (whichever runner it was): one
    # untimed process first.
    precision, runner = keys[0]
    rate = (trainer_rate if runner in TRAINERS else worker_rate)(args, runner, precision, shards, tokenizer)
    print(f"# untimed warm-up process: {runner} {precision} {rate:,.0f}", flush=True)
    for round_ in range(args.rounds):
        for precision, runner in keys if round_ % 2 == 0 else reversed(keys):
            rate = trainer_rate if runner in TRAINERS else worker_rate
            rates[(precision, runner)].append(rate(args, runner, precision, shards, tokenizer))
        print(f"# round {round_ + 1}: " + ", ".join(f"{r} {p} {v[-1]:,.0f}" for (p, r), v in rates.items()), flush=True)
    return rates


def table(rates: dict[tuple[str, str], list[float]]) -> str:
    """One row per (precision, runner): tokens/s and its ratio to bare (trainers), hf and hf-keep."""

    def ratio(key: tuple[str, str], other: tuple[str, str]) -> str:
        if key == other or other not in rates or key[1] in WORKERS and key[1] != "bare":
            return "-"
        per_round = [a / b for a, b in zip(rates[key], rates[other])]
        return f"**{statistics.median(per_round):.3f}x**; {', '.join(f'{x:.2f}' for x in per_round)}"

    lines = [
        "| precision | runner | tokens/s median (min-max) | vs bare (median; per round) | vs hf | vs hf-keep |",
        "|---|---|---|---|---|---|",
    ]
    for (precision, runner), values in rates.items():
        vs_bare = ratio((precision, runner), (precision, "bare")) if runner in TRAINERS else "-"
        lines.append(
            f"| {precision} | {runner} | {statistics.median(values):,.0f} ({min(values):,.0f}-"
            f"{max(values):,.0f}) | {vs_bare} | {ratio((precision, runner), (precision, 'hf'))} "
            f"| {ratio((precision, runner), (precision, 'hf-keep'))} |"
        )
    return "\n".join(lines)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def header(args: argparse.Namespace, shards: Path) -> str:
    versions = ", ".join(f"{name} {importlib.metadata.version(name)}" for name in ("deepspeed", "transformers"))
    threads = args.threads or torch.get_num_threads()
    gemms = "bf16 GEMM kernels" if native_bf16_gemm() else "no bf16 GEMM kernels in PyTorch"
    return (
        f"# {datetime.date.today()} {cpu_name()}, {os.cpu_count()} cores ({torch.backends.cpu.get_cpu_capability()},"
        f" {gemms}); torch {torch.__version__}, {versions}; threads per runner: {threads}\n"
        f"# {CONFIG} ({args.family}) d{args.d_model} L{args.layers} H{args.heads} KV{args.kv_heads} FFN{args.ffn}"
        f" V{args.vocab}"
        f" tie={args.tie}, micro batch {args.batch} x {args.seq}, grad_accum 1, shards {shards};"
        f" {args.rounds} rounds x {args.steps} steps (+{args.warmup} warm-up) per runner, each a fresh process\n"
        f"# command: python {' '.join(sys.argv)}"
    )


# ------------------------------------------------------------------------------------------ the profile


def profile_trainer(args: argparse.Namespace, shards: Path, tokenizer: Path) -> str:
    """cProfile of the trainer's steps after the warm-up (in this process), per step, by part of the step."""
    os.environ["DS_ACCELERATOR"] = "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    from deepspeed.runtime.engine import DeepSpeedEngine

    from data_pipeline.loader import StreamingLoader
    from megatransformer import cli
    from megatransformer.model.transformer import DecoderLM
    from megatransformer.training.engine import train_module as engine
    from megatransformer.training.loop import Trainer

    precision = args.precision.split(",")[0]
    run_dir = args.work / "runs" / f"profile-{args.profile_runner}-{precision}"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    profiler, calls, started, wall = cProfile.Profile(), 0, 0.0, 0.0
    step, evaluate = engine.TrainModule.step, Trainer.evaluate

    def profiled_step(self, *a, **kw):  # the profile starts with the first step after the warm-up ...
        nonlocal calls, started
        calls += 1
        if calls == args.warmup + 1:
            started = time.perf_counter()
            profiler.enable()
        return step(self, *a, **kw)

    def evaluate_unprofiled(self):  # ... and ends with the loop (the final evaluation follows it)
        nonlocal wall
        profiler.disable()
        wall = time.perf_counter() - started
        return evaluate(self)

    zero_stage, host_memory, cpu_bf16_matmul = TRAINERS[args.profile_runner]
    argv = [
        "train",
        "--config",
        CONFIG,
        *overrides(args, precision, zero_stage, run_dir, shards, tokenizer, host_memory, cpu_bf16_matmul),
    ]
    log = run_dir.with_suffix(".log")
    with (
        mock.patch.object(engine.TrainModule, "step", profiled_step),
        mock.patch.object(Trainer, "evaluate", evaluate_unprofiled),
        log.open("w") as out,
        contextlib.redirect_stdout(out),
    ):
        code = cli.main(argv)
    if code != 0:
        raise SystemExit(f"profile: megatransformer train exited {code}; its output: {log}")
    shutil.rmtree(run_dir / "checkpoints")
    stats = pstats.Stats(profiler)

    def seconds(fn: Callable | None = None, file: str | None = None, name: str | None = None) -> float:
        """Cumulative seconds of one function: by its code, or by file and name (DeepSpeed's NVTX decorator
        hides the code of what it wraps); at most one profiled function may match (0 s: never called)."""
        if fn is not None:
            code = fn.__code__
            file, name, line = code.co_filename, code.co_name, code.co_firstlineno
        else:
            line = None
        found = [v[3] for (f, l, n), v in stats.stats.items() if (f, n) == (file, name) and line in (None, l)]
        if len(found) > 1:
            raise SystemExit(f"profile: {len(found)} functions {name} in {file}; name the one to count")
        return found[0] if found else 0.0

    ds_file = sys.modules[DeepSpeedEngine.__module__].__file__
    step_total = seconds(step)
    # (part, its seconds, of those: the model's forward / torch's autograd / torch's AdamW, as in the bare step)
    parts: list[tuple[str, float, float | None]] = [
        ("loader next()", seconds(StreamingLoader.__iter__), None),
        ("to_device + masks (TrainModule.to_device)", seconds(engine.TrainModule.to_device), None),
        (
            "forward and loss (DeepSpeedEngine.forward; the loss's gradients too, head.linear_cross_entropy)",
            seconds(file=ds_file, name="forward"),
            seconds(DecoderLM.forward),
        ),
        (
            "backward (DeepSpeedEngine.backward)",
            seconds(file=ds_file, name="backward"),
            seconds(torch.autograd.backward),
        ),
        ("grad norm (unclipped_grad_norm; ZeRO-0 only)", seconds(engine.unclipped_grad_norm), None),
        (
            "optimizer (DeepSpeedEngine.step)",
            seconds(file=ds_file, name="step"),
            seconds(inspect.unwrap(torch.optim.AdamW.step)),
        ),
    ]
    parts.append(
        (
            "rest of TrainModule.step (counts, statistics all-reduce, skip check)",
            step_total - sum(s for _, s, _ in parts),
            None,
        )
    )
    # (the wall clock, not the profile's own total: Python called back from C++ (a TorchDispatchMode, as
    # cpu_bf16's) is left out of that total while it stays in the cumulative times of the parts)
    parts.append(("loop outside TrainModule.step (progress, grad-norm read, metrics record)", wall - step_total, None))
    lines = [
        f"## where the trainer's time goes: cProfile of {args.profile_runner} {precision}, steps "
        f"{args.warmup + 1}-{args.warmup + args.steps}, seconds per step",
        "(of which torch: the model's forward, torch's autograd backward, torch's AdamW step: the work a bare "
        "step does too; the rest of a part is the engine's)",
        "| part | s/step | share | of which torch, s/step |",
        "|---|---|---|---|",
    ]
    for label, total, inner in parts:
        torch_part = "-" if inner is None else f"{inner / args.steps:.4f}"
        lines.append(f"| {label} | {total / args.steps:.4f} | {total / wall:.1%} | {torch_part} |")
    lines.append(f"| total (profiled, wall clock) | {wall / args.steps:.4f} | 100% | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return worker(args)
    shards, tokenizer = prepare_data(args)
    print(header(args, shards), flush=True)
    if args.rounds:
        print(table(run_rounds(args, shards, tokenizer)), flush=True)
    if args.profile:
        print(profile_trainer(args, shards, tokenizer), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
