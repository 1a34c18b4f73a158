"""The GPU suite: one command, at most 8 minutes on one H100 or H200, no network.

    python bench/gpu_suite.py [--out DIR]      # on the GPU machine
    python bench/gpu_suite.py --dry            # on a CPU: the same bookkeeping with a tiny model

1. ``bench/gpu_check.py`` (the ``gpu`` tests, the step's host syncs, a short packed run).
2. The trainer's step against its bare step at 1.1B (TinyLlama's shape), ZeRO-1 bf16, compiled, on the same
   batches: rows of one long document each, then packed short documents. The trainer is ``megatransformer
   train``; the bare step (``--worker``) is the model with fp32 master weights, PyTorch's fused AdamW and the
   global norm clipped, fed by the same loader (``bench/train_step.py``'s Runner). Recompiles and graph breaks
   of both come from dynamo's own log (``TORCH_LOGS=recompiles,graph_breaks``) and the run log.
3. The trainer end to end: the packed run is ~30 steps with one checkpoint, whose stall is timed from the run's
   metrics (the step after it, less the median step).

Every figure goes to DIR/gpu_suite.json and a printed table. Exit 0 when every phase ran and the GPU check
passed (the targets are reported, not judged), 1 otherwise, 2 without CUDA (unless --dry). Each phase has its
own time limit (``LIMITS_S``): one that overruns is recorded as timed out and the suite goes on. ``--dry`` runs
on the CPU with a tiny model, uncompiled, and checks that every figure the report promises is there.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

CONFIG = "llama-style"
MODES = ("rows", "packed")  # one long document per row; short documents packed


@dataclasses.dataclass(frozen=True)
class Workload:
    model: dict
    vocab: int  # the model's (the tokenizer's is smaller: token ids fit)
    tokenizer_vocab: int
    seq: int
    batch: int
    warmup: int  # steps before timing (compilation, allocator warm-up)
    steps: int  # timed steps of the rows runs
    e2e_steps: int  # steps of the packed run, with one checkpoint
    compile: bool
    device: str
    peak_tflops: float | None  # None: the trainer's table of GPUs
    corpus_chars: int | None = None  # of the demo corpus (None: all of it)


GPU = Workload(
    model=dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, d_ff=5632),  # TinyLlama 1.1B
    vocab=32000,
    tokenizer_vocab=4096,
    seq=2048,
    batch=4,
    warmup=5,
    steps=10,
    e2e_steps=30,
    compile=True,
    device="cuda",
    peak_tflops=None,
)
DRY = Workload(
    model=dict(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=128),
    vocab=2048,
    tokenizer_vocab=2048,
    seq=256,
    batch=2,
    warmup=1,
    steps=3,
    e2e_steps=6,
    compile=False,
    device="cpu",
    peak_tflops=1.0,
    corpus_chars=300_000,
)
# seconds per phase (--limit PHASE=S overrides): 8 minutes in all; the 1.1B runs compile and save 15 GB at the end
LIMITS_S = {
    "gpu_check": 120,
    "data": 15,
    "trainer-rows": 100,
    "bare-rows": 60,
    "trainer-packed": 130,
    "bare-packed": 55,
}
TARGETS = {"trainer_over_bare": 0.95, "mfu": 0.45}  # issue targets at 1.1B bf16 on an H100 / H200
# dynamo's log lines (TORCH_LOGS=recompiles,graph_breaks) carry their artifact's tag; the run log's own do not
RECOMPILE = re.compile(r"\[__recompiles\].*Recompiling function")
GRAPH_BREAK = re.compile(r"\[__graph_breaks\] Graph break (in user code|\(user stack suppressed)")
DYNAMO_LOG = re.compile(r"\[__(recompiles|graph_breaks)")
RUN_LOG_COMPILE = re.compile(r"recompil|graph break", re.IGNORECASE)


def limit(wl: Workload, phase: str) -> int | None:
    """A phase's time limit on the GPU; none in a dry run (a busy CPU's pace says nothing)."""
    return LIMITS_S[phase] if wl.device == "cuda" else None


# ------------------------------------------------------------------------------------------ data


def megatransformer(*words: str) -> list[str]:
    return [sys.executable, "-m", "megatransformer.cli", *words]


def environment(wl: Workload) -> dict[str, str]:
    """This checkout's code; dynamo's recompiles and graph breaks in the output; DeepSpeed on the CPU when dry."""
    env = dict(os.environ, TORCH_LOGS="recompiles,graph_breaks", PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    if wl.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    return env


def prepare_data(work: Path, wl: Workload) -> dict[str, dict[str, str]]:
    """The demo corpus (built in, no network) sharded twice with one tokenizer: as files of ~4 rows' worth of
    text each (one document per file: rows of one document) and as its short blocks (packed)."""
    corpus, tokenizer = work / "corpus.txt", work / "tokenizer.json"
    data = {mode: {"train": str(work / f"shards-{mode}"), "tokenizer": str(tokenizer)} for mode in MODES}
    if all((Path(d["train"]) / "manifest.json").is_file() for d in data.values()):
        return data  # (prepared by an earlier run into this --out; the manifest is written last)
    run = dict(env=environment(wl), check=True, capture_output=True, timeout=limit(wl, "data"))
    subprocess.run(megatransformer("data", "demo-corpus", "--out", str(corpus)), **run)
    if wl.corpus_chars is not None:
        corpus.write_text(corpus.read_text()[: wl.corpus_chars])
    vocab = str(wl.tokenizer_vocab)
    subprocess.run(
        megatransformer("data", "tokenizer", "--input", str(corpus), "--vocab-size", vocab, "--out", str(tokenizer)),
        **run,
    )
    long_docs = work / "long"
    long_docs.mkdir(exist_ok=True)
    text, size = corpus.read_text(), 4 * 4 * wl.seq  # ~4 characters a token: ~4 rows a document
    for i in range(0, len(text) - size, size):
        (long_docs / f"{i // size:05d}.txt").write_text(text[i : i + size])
    for mode, source, per in (("rows", long_docs, "file"), ("packed", corpus, "block")):
        shard = ("data", "shard", "--input", str(source), "--tokenizer", str(tokenizer), "--out", data[mode]["train"])
        subprocess.run(megatransformer(*shard, "--doc-per", per, "--overwrite"), **run)
    return data


def overrides(wl: Workload, data: dict[str, str], run_dir: Path, steps: int, checkpoint_every: int) -> list[str]:
    """The trainer's (and the bare step's) run config over the llama-style one: one log line per step."""
    m = wl.model
    fields = [
        f"run_dir={run_dir}",
        "precision=bf16",
        "parallel.zero_stage=1",
        f"train.compile={str(wl.compile).lower()}",
        f"model.d_model={m['d_model']}",
        f"model.n_layers={m['n_layers']}",
        f"model.n_heads={m['n_heads']}",
        f"model.n_kv_heads={m['n_kv_heads']}",
        f"model.d_ff={m['d_ff']}",
        f"model.vocab_size={wl.vocab}",
        f"model.max_seq_len={wl.seq}",
        "model.tie_embeddings=false",
        "model.attention_backend=auto",
        f"data.train={data['train']}",
        f"data.tokenizer={data['tokenizer']}",
        f"data.seq_len={wl.seq}",
        "data.streams=4",
        f"train.max_steps={steps}",
        f"train.micro_batch_size={wl.batch}",
        "train.global_batch_size=null",
        "train.grad_accum=1",
        "train.log_every=1",
        "train.eval_every=0",
        "train.eval_batches=1",
        "train.sample_prompt=",
        f"checkpoint.every={checkpoint_every}",
        "wandb.mode=disabled",
    ]
    return fields + ([f"train.peak_tflops={wl.peak_tflops}"] if wl.peak_tflops else [])


# ------------------------------------------------------------------------------------------ the trainer


def compile_events(output: str) -> dict:
    """Dynamo's recompiles and graph breaks in a process's output, and the run log's own lines about them."""
    lines = output.splitlines()
    return {
        "recompiles": sum(bool(RECOMPILE.search(line)) for line in lines),
        "graph_breaks": sum(bool(GRAPH_BREAK.search(line)) for line in lines),
        "run_log_lines": [line for line in lines if RUN_LOG_COMPILE.search(line) and not DYNAMO_LOG.search(line)][:5],
    }


def step_times(records: list[dict]) -> list[tuple[int, float]]:
    """(step, seconds) of each logged training step (``train.log_every=1``: a record's window is one step)."""
    steps, before = [], 0
    for record in records:
        steps.append((record["step"], (record["tokens"] - before) / record["tokens_per_s"]))
        before = record["tokens"]
    return steps


def checkpoint_stall(records: list[dict], every: int, typical: float) -> float | None:
    """Seconds the checkpoint after step ``every`` added: the gap between that step's record and the next one's,
    less a typical step."""
    times = {r["step"]: r["time"] for r in records}
    if every not in times or every + 1 not in times:
        return None
    return times[every + 1] - times[every] - typical


def trainer(wl: Workload, mode: str, data: dict[str, str], work: Path) -> dict:
    """One ``megatransformer train`` run: its median step after the warm-up, MFU, recompiles; the packed run is
    the end-to-end one (more steps, one checkpoint timed)."""
    end_to_end = mode == "packed"
    steps = wl.e2e_steps if end_to_end else wl.warmup + wl.steps
    every = steps - wl.steps // 2 if end_to_end else steps  # (a checkpoint with timed steps either side)
    run_dir = work / f"run-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)
    command = megatransformer("train", "--config", CONFIG, *overrides(wl, data, run_dir, steps, every))
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, env=environment(wl), capture_output=True, text=True, timeout=limit(wl, f"trainer-{mode}")
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "timed_out": True, "limit_s": LIMITS_S[f"trainer-{mode}"]}
    finally:
        checkpoints = run_dir / "checkpoints"
        sizes = checkpoint_sizes(checkpoints)
        shutil.rmtree(checkpoints, ignore_errors=True)  # (15 GB each at 1.1B)
    wall = time.perf_counter() - started
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []
    records = [r for r in records if r.get("kind") == "train"]
    if done.returncode != 0 or len(records) != steps:
        return {"ok": False, "exit": done.returncode, "output": (done.stdout + done.stderr)[-3000:]}
    timed = [(s, t) for s, t in step_times(records) if s > wl.warmup and s != every + 1]
    median = statistics.median(t for _, t in timed)
    mfus = [r["mfu"] for r in records if r["step"] > wl.warmup and r.get("mfu") is not None]
    report = {
        "ok": True,
        "steps": steps,
        "step_s": median,
        "tokens_per_s": wl.batch * wl.seq / median,
        "mfu": statistics.median(mfus) if mfus else None,
        "max_memory_gib": records[-1].get("max_memory_gib"),
        "wall_s": wall,
        "attention": [line for line in done.stdout.splitlines() if line.startswith("attention:")],
        "compile": compile_events(done.stdout + done.stderr),
    }
    if end_to_end:
        report["checkpoint_step"] = every
        report["checkpoint_stall_s"] = checkpoint_stall(records, every, median)
        report["checkpoint_gib"] = sizes[0] / 2**30 if sizes else None  # (the first: the one timed)
    return report


def checkpoint_sizes(checkpoints: Path) -> list[int]:
    """Bytes of each checkpoint directory, oldest first (their names hold the step, zero-padded)."""
    if not checkpoints.is_dir():
        return []
    folders = sorted(d for d in checkpoints.iterdir() if d.is_dir())
    return [sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) for folder in folders]


# ------------------------------------------------------------------------------------------ the bare step


def bare(wl: Workload, mode: str, data: dict[str, str], work: Path) -> dict:
    """The bare step in a fresh process (``--worker``), on the batches the trainer's loader makes."""
    command = [sys.executable, __file__, "--worker", mode, "--data", json.dumps(data), "--out", str(work)]
    command += ["--dry"] if wl.device == "cpu" else []
    try:
        done = subprocess.run(
            command, env=environment(wl), capture_output=True, text=True, timeout=limit(wl, f"bare-{mode}")
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "timed_out": True, "limit_s": LIMITS_S[f"bare-{mode}"]}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"ok": False, "exit": done.returncode, "output": (done.stdout + done.stderr)[-3000:]}
    return {"ok": True, **json.loads(lines[-1]), "compile": compile_events(done.stdout + done.stderr)}


def worker(wl: Workload, mode: str, data: dict[str, str], work: Path) -> int:
    """The bare step, timed per step (each ends in ``loss.item()``); prints one JSON line."""
    import torch
    import train_step

    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.config import load_config
    from megatransformer.flops import document_lengths, documents_flops, model_size
    from megatransformer.model import build_model
    from megatransformer.model.gpu_cores import VARLEN_BACKENDS, activate_for
    from megatransformer.training.data import build_run_loader
    from megatransformer.training.engine import batch_to_device
    from megatransformer.training.metrics import peak_tflops

    steps = wl.warmup + wl.steps
    cfg = load_config(CONFIG, overrides(wl, data, work / "unused", steps, steps))
    device = torch.device(wl.device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    backend = cfg.model.attention_backend
    activate_for(backend, device.type)
    o = cfg.optim
    adamw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=True)
    runner = train_step.Runner("ours", model, "bf16", wl.device, wl.compile, adamw, grad_clip=cfg.train.grad_clip)
    batches = iter(build_run_loader(cfg, "train", wl.batch, 0, 1, load_tokenizer(cfg.data.tokenizer)))
    varlen = device.type == "cuda" and backend in VARLEN_BACKENDS
    size = model_size(cfg.model, wl.seq)
    times, flops, documents = [], 0.0, 0
    for step in range(steps):
        start = time.perf_counter()
        batch = next(batches)
        inputs, labels, masks = batch_to_device(batch, device, cfg.model.arch, varlen)
        runner.step(inputs.pop("input_ids"), labels, **inputs, masks=masks)
        if step >= wl.warmup:
            times.append(time.perf_counter() - start)
            lengths = document_lengths(batch["segment_ids"].numpy(), tuple(batch["input_ids"].shape))
            flops += documents_flops(size, lengths)
            documents += len(lengths)
    peak = peak_tflops(cfg, wl.device)
    report = {
        "step_s": statistics.median(times),
        "tokens_per_s": wl.batch * wl.seq / statistics.median(times),
        "mfu": flops / sum(times) / (peak * 1e12) if peak else None,
        "documents_per_row": documents / (wl.steps * wl.batch),
    }
    if device.type == "cuda":
        report["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    print(json.dumps(report))
    return 0


# ------------------------------------------------------------------------------------------ the suite


def gpu_check(wl: Workload, work: Path) -> dict:
    """``bench/gpu_check.py``'s report (dry: its answer on a machine without CUDA, exit 2)."""
    command = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(work / "gpu_check")]
    try:
        done = subprocess.run(
            command, env=environment(wl), capture_output=True, text=True, timeout=limit(wl, "gpu_check")
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "timed_out": True, "limit_s": LIMITS_S["gpu_check"]}
    report_file = work / "gpu_check" / "gpu_check.json"
    if report_file.is_file():
        return json.loads(report_file.read_text())
    return {"ok": wl.device == "cpu" and done.returncode == 2, "exit": done.returncode, "stderr": done.stderr[-2000:]}


def compare(trainer_run: dict, bare_run: dict) -> dict:
    """The trainer's speed as a fraction of its bare step's (1.0: as fast)."""
    if not (trainer_run.get("ok") and bare_run.get("ok")):
        return {"trainer_over_bare": None}
    return {"trainer_over_bare": bare_run["step_s"] / trainer_run["step_s"]}


def versions() -> dict:
    import torch

    from megatransformer.model import gpu_cores
    from megatransformer.model.attention import flash_attn_module

    flash = flash_attn_module()
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": importlib.metadata.version("deepspeed"),
        "flash_attn": None if flash is None else flash.__version__,
        "flash_registry": {core: gpu_cores.registry_impl_installed(core) for core in gpu_cores.REGISTRY_IMPLS},
        "date": datetime.date.today().isoformat(),
    }


def run_suite(wl: Workload, work: Path) -> dict:
    report: dict = {"versions": versions(), "workload": dataclasses.asdict(wl), "limits_s": LIMITS_S, "phases_s": {}}

    def phase(name: str, call):
        started = time.perf_counter()
        result = call()
        report["phases_s"][name] = round(time.perf_counter() - started, 1)
        print(f"# {name}: {report['phases_s'][name]} s", flush=True)
        return result

    report["gpu_check"] = phase("gpu_check", lambda: gpu_check(wl, work))
    for mode in MODES:
        report[mode] = {"trainer": {"ok": False}, "bare": {"ok": False}, "trainer_over_bare": None}
    try:
        data = phase("data", lambda: prepare_data(work, wl))
    except subprocess.SubprocessError as error:  # (a command failed or overran: nothing to train on)
        stderr = (getattr(error, "stderr", None) or b"").decode(errors="replace")
        report["data"] = {"ok": False, "error": str(error), "stderr": stderr[-2000:]}
        data = None
    for mode in MODES if data else ():
        run = phase(f"trainer-{mode}", lambda mode=mode: trainer(wl, mode, data[mode], work))
        reference = phase(f"bare-{mode}", lambda mode=mode: bare(wl, mode, data[mode], work))
        report[mode] = {"trainer": run, "bare": reference, **compare(run, reference)}
    report["total_s"] = round(sum(report["phases_s"].values()), 1)
    report["ok"] = bool(report["gpu_check"].get("ok")) and all(
        report[mode][side].get("ok") for mode in MODES for side in ("trainer", "bare")
    )
    return report


def missing_figures(report: dict) -> list[str]:
    """The figures a complete report holds that this one lacks (None or absent)."""
    wanted = [f"{mode}.{side}.{key}" for mode in MODES for side in ("trainer", "bare") for key in ("step_s", "mfu")]
    wanted += [f"{mode}.trainer.compile.recompiles" for mode in MODES] + [
        f"{mode}.bare.compile.recompiles" for mode in MODES
    ]
    wanted += [f"{mode}.trainer_over_bare" for mode in MODES]
    wanted += ["packed.trainer.checkpoint_stall_s", "packed.trainer.checkpoint_gib", "packed.bare.documents_per_row"]
    missing = []
    for path in wanted:
        value = report
        for key in path.split("."):
            value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            missing.append(path)
    return missing


def table(report: dict) -> str:
    def number(value, form: str) -> str:
        return "-" if value is None else format(value, form)

    rows = [
        "| workload | runner | step s | tokens/s | MFU | recompiles | graph breaks | trainer / bare |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode in MODES:
        for side in ("trainer", "bare"):
            r = report[mode][side]
            c = r.get("compile", {})
            ratio = number(report[mode]["trainer_over_bare"], ".3f") if side == "trainer" else ""
            mfu = None if r.get("mfu") is None else 100 * r["mfu"]
            rows.append(
                f"| {mode} | {side} | {number(r.get('step_s'), '.4f')} | {number(r.get('tokens_per_s'), ',.0f')} "
                f"| {number(mfu, '.1f')}% | {number(c.get('recompiles'), 'd')} | {number(c.get('graph_breaks'), 'd')} "
                f"| {ratio} |"
            )
    packed = report["packed"]["trainer"]
    rows.append("")
    stall, size = number(packed.get("checkpoint_stall_s"), ".2f"), number(packed.get("checkpoint_gib"), ".2f")
    rows.append(
        f"checkpoint at step {packed.get('checkpoint_step')}: stall {stall} s, {size} GiB; "
        f"gpu_check ok: {report['gpu_check'].get('ok')}; "
        f"phases {report['phases_s']} (total {report['total_s']} s)"
    )
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="work directory and gpu_suite.json (default: a new temp dir)")
    p.add_argument("--dry", action="store_true", help="on the CPU with a tiny model: checks the bookkeeping")
    p.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="PHASE=S",
        help=f"a phase's time limit; phases: {list(LIMITS_S)}",
    )
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)  # the bare step of one mode
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for limit in args.limit:
        phase, _, seconds = limit.partition("=")
        if phase not in LIMITS_S or not seconds.isdigit():
            p.error(f"--limit {limit}: give PHASE=SECONDS, PHASE one of {list(LIMITS_S)}")
        LIMITS_S[phase] = int(seconds)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wl = DRY if args.dry else GPU
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu_suite-"))
    if args.worker:
        return worker(wl, args.worker, json.loads(args.data), out)
    import torch

    if not args.dry and not torch.cuda.is_available():
        print("gpu_suite: error: no CUDA device here; run it on a GPU machine, or --dry on a CPU", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    report = run_suite(wl, out)
    report["missing"] = missing_figures(report)
    (out / "gpu_suite.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"# report: {out / 'gpu_suite.json'}")
    if report["missing"]:
        print(f"# missing figures: {', '.join(report['missing'])}")
    return 0 if report["ok"] and not report["missing"] else 1


if __name__ == "__main__":
    sys.exit(main())
