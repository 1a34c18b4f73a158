"""The GPU suite: one command on one H100 or H200, no network; with the wheels' install, one device call of 600 s.

    python bench/gpu_suite.py --out DIR [--work DIR]   # on the GPU machine
    python bench/gpu_suite.py --dry --out DIR          # on a CPU: the same bookkeeping with a tiny model

1. ``bench/gpu_check.py`` (the ``gpu`` tests, the step's host syncs, a short packed run).
2. The trainer's step against its bare step at 1.1B (TinyLlama's shape), ZeRO-1 bf16, compiled, on the same
   batches: rows of one long document each, then packed short documents. The trainer is ``megatransformer
   train``; the bare step (``--worker``) is the model with fp32 master weights, PyTorch's fused AdamW and the
   global norm clipped, fed by the same loader (``bench/train_step.py``'s Runner), each Transformer block compiled
   as the trainer compiles it. Recompiles and graph breaks of both come from dynamo's own log
   (``TORCH_LOGS=recompiles,graph_breaks``) and the run log. On the rows both profile 3 steps after their timed
   ones (the trainer through ``train.profile``): where the trainer's extra time goes, operator by operator.
3. The trainer end to end: the packed run writes the suite's one checkpoint (the others ``checkpoint.final=
   false``), its stall and size from the run's metrics.
4. Muon at 1.1B on one rank: the trainer's step with ``optim.name=muon`` against AdamW's, and the bf16
   Newton-Schulz iterations of one step's matrices timed alone.
5. ZeRO-3 compiled on one rank: each block's forward compiled between DeepSpeed's gather and release hooks (its
   step, recompiles and graph breaks).
6. Tensor parallelism with compile over NCCL (tp 2, torchrun): needs two GPUs; on one it is skipped with its
   reason (NCCL runs one rank per GPU, and at tp 1 DeepSpeed applies no AutoTP: nothing of it to check).

The work (data, runs, the compile caches every phase shares: ``CACHE_ENV``) goes to ``--work`` (default: a new
directory under /tmp; each process's output in its ``logs/``), never into ``--out``, which gets ``gpu_suite.json``
and ``gpu_suite.md`` only, written after every phase and after an exception (what is known by then). Exit 0 when
every phase ran (or was skipped with its reason) and the GPU check passed (the targets are reported, not judged), 1
otherwise, 2 without CUDA (unless --dry). Each phase has its own time limit (``LIMITS_S``) and runs in a session of
its own: one that overruns is killed with every process below it, recorded as timed out with what it had printed
and logged, and the suite goes on. ``--dry`` runs every phase on the CPU with a tiny model, uncompiled, checks
that every figure the report promises is there, and records the modules each phase's processes import, against the
GPU image and ``bench/gpu_wheels.sh``'s core list (:func:`import_check`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import datetime
import functools
import importlib.metadata
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

CONFIG = "llama-style"
MODES = ("rows", "packed")  # one long document per row; short documents packed
TP = 2  # the tensor-parallel phase's degree (one GPU per rank under NCCL)
PROFILED, PROFILE_STEPS = "rows", 3  # the mode whose trainer and bare step are profiled, after their timed steps


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
    muon_steps: int  # timed steps of the Muon run (after the warm-up)
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
    muon_steps=5,
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
    muon_steps=2,
    compile=False,
    device="cpu",
    peak_tflops=1.0,
    corpus_chars=300_000,
)
# Seconds per phase (--limit PHASE=S overrides), sized for a first run with empty compile caches (compile is on by
# default on CUDA): the first 1.1B process compiles a Transformer block's graphs into the shared caches and the later
# ones mostly read them; gpu_check compiles its own small model; the packed run writes the one checkpoint (~15 GB).
# Each is about twice its time on the H200 of 2026-12-04 (docs/gpu.md; trainer-zero3's compiles its own graphs: a
# block's forward between ZeRO-3's hooks). One device call holds the wheels' install and the suite on one GPU, where
# trainer-tp is skipped: 555 s of phases + INSTALL_S + START_S = 580 s of CALL_S's 600 (two GPUs add trainer-tp's
# 55 s: lower another phase's limit there).
LIMITS_S = {
    "gpu_check": 150,
    "data": 30,
    "trainer-rows": 80,
    "bare-rows": 40,
    "trainer-packed": 90,
    "bare-packed": 40,
    "trainer-muon": 50,
    "muon-ns": 15,
    "trainer-zero3": 60,
    "trainer-tp": 55,
}
CALL_S = 600  # one device call: bench/gpu_wheels.sh install core, then the suite (docs/gpu.md)
INSTALL_S = 15  # the install: ~11 MB of wheels from one tar, no network
START_S = 10  # the suite's own start-up (torch, versions) and its reports (with the install: 19.5 s on the H200)
TARGETS = {"trainer_over_bare": 0.95, "mfu": 0.45}  # issue targets at 1.1B bf16 on an H100 / H200
# dynamo's log lines (TORCH_LOGS=recompiles,graph_breaks) carry their artifact's tag; the run log's own do not
RECOMPILE = re.compile(r"\[__recompiles\].*Recompiling function")
GRAPH_BREAK = re.compile(r"\[__graph_breaks\] Graph break (in user code|\(user stack suppressed)")
DYNAMO_LOG = re.compile(r"\[__(recompiles|graph_breaks)")
RUN_LOG_COMPILE = re.compile(r"recompil|graph break", re.IGNORECASE)


def limit(wl: Workload, phase: str) -> int | None:
    """A phase's time limit on the GPU; none in a dry run (a busy CPU's pace says nothing)."""
    return LIMITS_S[phase] if wl.device == "cuda" else None


# ------------------------------------------------------------------------------------------ processes


def run_process(
    command: list[str], env: dict[str, str], timeout: float | None, log: Path
) -> subprocess.CompletedProcess:
    """``command`` in a session of its own, its output to ``log``.out and ``log``.err (text). Past ``timeout`` seconds
    its whole process tree is killed and TimeoutExpired raised with the output so far; whatever happens, nothing of it
    is left running (a test, a step probe or a rank holding the GPU)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    paths = Path(f"{log}.out"), Path(f"{log}.err")
    timed_out = False
    with open(paths[0], "w") as out, open(paths[1], "w") as err:
        process = subprocess.Popen(command, env=env, stdout=out, stderr=err, start_new_session=True)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_tree(process)
    stdout, stderr = (path.read_text(errors="replace") for path in paths)
    if timed_out:
        raise subprocess.TimeoutExpired(command, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def kill_tree(process: subprocess.Popen, seconds: float = 10.0) -> None:
    """SIGKILL ``process``'s process group and the group of every process below it (torchrun starts each rank in a
    session of its own), reap it, and wait (at most ``seconds``) until every one has ended: the next phase finds the
    GPU free. Not SIGTERM: the trainer answers it with a checkpoint."""
    below = descendants(process.pid)
    groups = {process.pid}
    for pid in below:
        with contextlib.suppress(ProcessLookupError):
            groups.add(os.getpgid(pid))
    groups.discard(os.getpgrp())  # (never the suite's own)
    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, signal.SIGKILL)
    process.wait()
    deadline = time.monotonic() + seconds
    while any(map(running, below)) and time.monotonic() < deadline:
        time.sleep(0.05)


def running(pid: int) -> bool:
    """Whether process ``pid`` has not ended (a zombie has: only its parent's reading of its exit is left)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def descendants(pid: int) -> list[int]:
    """The processes below ``pid``, from /proc."""
    children = collections.defaultdict(list)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            parent = int(stat.read_text().rpartition(")")[2].split()[1])  # (the field after the command's name)
            children[parent].append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children[todo.pop()]
        found += below
        todo += below
    return found


def outputs(stdout: str, stderr: str) -> dict:
    """The ends of a process's output, for the report (the whole of it stays in the work directory's logs/)."""
    return {"stdout": stdout[-2000:], "stderr": stderr[-3000:]}


def overran(error: subprocess.TimeoutExpired, phase: str) -> dict:
    """A phase past its limit: what it had printed by then."""
    return {"ok": False, "timed_out": True, "limit_s": LIMITS_S[phase], **outputs(error.output, error.stderr)}


def read_metrics(path: Path) -> list[dict]:
    """A run's metrics.jsonl, as far as it was written: a line cut off by a killed run (or otherwise unreadable)
    is skipped."""
    records = []
    for line in path.read_text(errors="replace").splitlines() if path.is_file() else []:
        with contextlib.suppress(json.JSONDecodeError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def last_json(text: str) -> dict | None:
    """The last line of ``text`` that is a JSON object (a worker's one line of results), or None."""
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)
    return None


# ------------------------------------------------------------------------------------------ data


def megatransformer(*words: str) -> list[str]:
    return [sys.executable, "-m", "megatransformer.cli", *words]


# The compile caches every phase's processes share (under the work directory): PyTorch Inductor's (its FX graph
# and autotuning caches), Triton's kernels, and flash-attn 4's JIT-compiled CuTe DSL kernels (its persistent cache
# is off unless enabled: flash_attn/cute/cache_utils.py in 4.0.0b36), CUTLASS's own DSL cache beside it.
CACHE_ENV = {
    "TORCHINDUCTOR_CACHE_DIR": "inductor",
    "TRITON_CACHE_DIR": "triton",
    "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "flash-attn-4",
    "CUTE_DSL_CACHE_DIR": "cute-dsl",
}
RECORDER = ROOT / "bench" / "import_recorder"  # its sitecustomize.py writes each process's imports (dry runs)


def environment(wl: Workload, work: Path) -> dict[str, str]:
    """This checkout's code; dynamo's recompiles and graph breaks in the output; the shared compile caches;
    DeepSpeed on the CPU and the import recorder when dry."""
    env = dict(os.environ, TORCH_LOGS="recompiles,graph_breaks", PYTHONUNBUFFERED="1")
    env.update({name: str(work / "cache" / folder) for name, folder in CACHE_ENV.items()})
    env["FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED"] = "1"
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]
    if wl.device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
        env["MT_RECORD_IMPORTS"] = str(work / "imports")
        paths.insert(0, str(RECORDER))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
    return env


def prepare_data(work: Path, wl: Workload, seconds_by_command: dict[str, float]) -> dict[str, dict[str, str]]:
    """The demo corpus (built in, no network) sharded twice with one tokenizer: as files of ~4 rows' worth of
    text each (one document per file: rows of one document) and as its short blocks (packed). Its commands share
    the data phase's limit (TimeoutExpired past it; CalledProcessError where one fails); each one's seconds go
    into ``seconds_by_command`` as it ends."""
    corpus, tokenizer = work / "corpus.txt", work / "tokenizer.json"
    data = {mode: {"train": str(work / f"shards-{mode}"), "tokenizer": str(tokenizer)} for mode in MODES}
    if all((Path(d["train"]) / "manifest.json").is_file() for d in data.values()):
        return data  # (prepared by an earlier run into this --work; the manifest is written last)
    env, seconds = environment(wl, work), limit(wl, "data")
    deadline = None if seconds is None else time.monotonic() + seconds

    def run(name: str, *words: str) -> None:
        started = time.monotonic()
        left = None if deadline is None else max(deadline - started, 0.0)
        try:
            done = run_process(megatransformer(*words), env, left, work / "logs" / f"data-{name}")
        finally:
            seconds_by_command[name] = round(time.monotonic() - started, 1)
        if done.returncode != 0:
            raise subprocess.CalledProcessError(done.returncode, done.args, done.stdout, done.stderr)

    run("corpus", "data", "demo-corpus", "--out", str(corpus))
    if wl.corpus_chars is not None:
        corpus.write_text(corpus.read_text()[: wl.corpus_chars])
    vocab = str(wl.tokenizer_vocab)
    run("tokenizer", "data", "tokenizer", "--input", str(corpus), "--vocab-size", vocab, "--out", str(tokenizer))
    long_docs = work / "long"
    long_docs.mkdir(exist_ok=True)
    text, size = corpus.read_text(), 4 * 4 * wl.seq  # ~4 characters a token: ~4 rows a document
    for i in range(0, len(text) - size, size):
        (long_docs / f"{i // size:05d}.txt").write_text(text[i : i + size])
    for mode, source, per in (("rows", long_docs, "file"), ("packed", corpus, "block")):
        shard = ("data", "shard", "--input", str(source), "--tokenizer", str(tokenizer), "--out", data[mode]["train"])
        run(f"shard-{mode}", *shard, "--doc-per", per, "--overwrite")
    return data


def data_phase(wl: Workload, work: Path) -> dict:
    """The data phase's result: the shards of each mode (``paths``), or why there are none (nothing to train on);
    either way the seconds of each of its commands."""
    seconds: dict[str, float] = {}
    try:
        return {"ok": True, "paths": prepare_data(work, wl, seconds), "seconds": seconds}
    except subprocess.TimeoutExpired as error:
        return {**overran(error, "data"), "seconds": seconds}
    except subprocess.CalledProcessError as error:
        return {"ok": False, "error": str(error), **outputs(error.output, error.stderr), "seconds": seconds}


def overrides(wl: Workload, data: dict[str, str], run_dir: Path, steps: int, save: bool) -> list[str]:
    """The trainer's (and the bare step's) run config over the llama-style one: one log line per step; ``save``:
    the run's one checkpoint, at its end (``checkpoint.final``), else none."""
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
        f"checkpoint.every={steps}",
        f"checkpoint.final={str(save).lower()}",
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


def saved(records: list[dict]) -> list[dict]:
    """The run's checkpoints from its metrics (``kind`` checkpoint): step, stall (setup: of it what a run's first
    save sets up), background write, bytes."""
    return [
        {
            "step": r["step"],
            "stall_s": r["ckpt_stall_s"],
            "setup_s": r.get("ckpt_setup_s"),
            "write_s": r["ckpt_write_s"],
            "gib": r["ckpt_bytes"] / 2**30,
        }
        for r in records
        if r.get("kind") == "checkpoint"
    ]


@dataclasses.dataclass(frozen=True)
class Run:
    """One ``megatransformer train`` run of the suite."""

    phase: str  # its LIMITS_S key
    mode: str  # the data: rows or packed
    steps: int
    save: bool = False  # the suite's one checkpoint
    extra: tuple[str, ...] = ()  # overrides beyond the suite's
    nproc: int = 1  # ranks (torchrun over more than one)
    tp: int = 1  # their tensor-parallel degree (the data-parallel degree: nproc / tp)
    profile: int = 0  # steps profiled after the timed ones (train.profile), the last of ``steps``


def trainer(wl: Workload, run: Run, data: dict[str, str], work: Path) -> dict:
    """One ``megatransformer train`` run: its median step after the warm-up, MFU, recompiles, its checkpoint."""
    run_dir = work / f"run-{run.phase}"
    shutil.rmtree(run_dir, ignore_errors=True)
    window = [f"train.profile.start={run.steps - run.profile + 1}", f"train.profile.steps={run.profile}"]
    words = ("train", "--config", CONFIG, *overrides(wl, data, run_dir, run.steps, run.save), *run.extra)
    words += tuple(window) if run.profile else ()
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={run.nproc}"]
    command = [*launcher, "-m", "megatransformer.cli", *words] if run.nproc > 1 else megatransformer(*words)
    metrics = run_dir / "metrics.jsonl"
    started = time.perf_counter()
    try:
        done = run_process(command, environment(wl, work), limit(wl, run.phase), work / "logs" / run.phase)
    except subprocess.TimeoutExpired as error:  # (what it had done by then: the compiler's work, the steps logged)
        return {
            **overran(error, run.phase),
            "compile": compile_events(error.output + error.stderr),
            "metrics": read_metrics(metrics),
        }
    finally:
        shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)  # (15 GB at 1.1B)
    wall = time.perf_counter() - started
    records = read_metrics(metrics)
    steps = [r for r in records if r.get("kind") == "train"]
    if done.returncode != 0 or len(steps) != run.steps:
        return {"ok": False, "exit": done.returncode, **outputs(done.stdout, done.stderr), "metrics": records}
    last_timed = run.steps - run.profile
    timed = [t for s, t in step_times(steps) if wl.warmup < s <= last_timed]
    mfus = [r["mfu"] for r in steps if wl.warmup < r["step"] <= last_timed and r.get("mfu") is not None]
    median = statistics.median(timed)
    report = {
        "ok": True,
        "steps": run.steps,
        "step_s": median,
        "tokens_per_s": wl.batch * wl.seq * (run.nproc // run.tp) / median,
        "mfu": statistics.median(mfus) if mfus else None,
        "max_memory_gib": steps[-1].get("max_memory_gib"),
        "wall_s": wall,
        "attention": [line for line in done.stdout.splitlines() if line.startswith("attention:")],
        "compile": compile_events(done.stdout + done.stderr),
        "checkpoints": saved(records),
    }
    profile = run_dir / "profile" / "rank_00000.json"
    if run.profile and profile.is_file():  # (else the run log says why, and the report misses its figures)
        report["profile"] = json.loads(profile.read_text())
    return report


# ------------------------------------------------------------------------------------------ the bare step


def bare(wl: Workload, mode: str, data: dict[str, str], work: Path, phase: str | None = None) -> dict:
    """The bare step (``mode`` rows or packed), or Newton-Schulz alone (``mode`` muon-ns), in a fresh process
    (``--worker``), on the batches the trainer's loader makes."""
    phase = phase or f"bare-{mode}"
    command = [sys.executable, __file__, "--worker", mode, "--data", json.dumps(data), "--work", str(work)]
    command += ["--dry"] if wl.device == "cpu" else []
    try:
        done = run_process(command, environment(wl, work), limit(wl, phase), work / "logs" / phase)
    except subprocess.TimeoutExpired as error:
        return {**overran(error, phase), "compile": compile_events(error.output + error.stderr)}
    result = last_json(done.stdout)
    if done.returncode != 0 or result is None:
        return {"ok": False, "exit": done.returncode, **outputs(done.stdout, done.stderr)}
    return {"ok": True, **result, "compile": compile_events(done.stdout + done.stderr)}


def median_mfu(flops: list[float], seconds: list[float], peak_tflops: float | None) -> float | None:
    """The median of the steps' MFUs, as the trainer's runs report theirs (and their step time: a step that
    recompiles is one step, not a share of all of them)."""
    if not peak_tflops:
        return None
    return statistics.median(f / s / (peak_tflops * 1e12) for f, s in zip(flops, seconds, strict=True))


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
    from megatransformer.training.engine.compiled import compile_blocks
    from megatransformer.training.engine.train_module import batch_to_device
    from megatransformer.training.observability.metrics import peak_tflops
    from megatransformer.training.observability.profiling import activities, write_profile

    steps = wl.warmup + wl.steps
    cfg = load_config(CONFIG, overrides(wl, data, work / "unused", steps, False))
    device = torch.device(wl.device)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model)
    backend = cfg.model.attention_backend
    activate_for(backend, device.type)
    o = cfg.optim
    adamw = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, fused=True)
    if wl.compile:  # each Transformer block, as the trainer compiles them: its graphs, read from the shared caches
        compile_blocks(model)
    runner = train_step.Runner("ours", model, "bf16", wl.device, False, adamw, grad_clip=cfg.train.grad_clip)
    batches = iter(build_run_loader(cfg, "train", wl.batch, 0, 1, load_tokenizer(cfg.data.tokenizer)))
    varlen = device.type == "cuda" and backend in VARLEN_BACKENDS
    size = model_size(cfg.model, wl.seq)
    times, flops, documents = [], [], 0

    def one_step() -> dict:
        batch = next(batches)
        inputs, labels, masks = batch_to_device(batch, device, cfg.model.arch, varlen)
        runner.step(inputs.pop("input_ids"), labels, **inputs, masks=masks)
        return batch

    for step in range(steps):
        start = time.perf_counter()
        batch = one_step()
        if step >= wl.warmup:
            times.append(time.perf_counter() - start)
            lengths = document_lengths(batch["segment_ids"].numpy(), tuple(batch["input_ids"].shape))
            flops.append(documents_flops(size, lengths))
            documents += len(lengths)
    peak = peak_tflops(cfg, wl.device)
    report = {
        "step_s": statistics.median(times),
        "tokens_per_s": wl.batch * wl.seq / statistics.median(times),
        "mfu": median_mfu(flops, times, peak),
        "documents_per_row": documents / (wl.steps * wl.batch),
    }
    if device.type == "cuda":
        report["max_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    if mode == PROFILED:  # the trainer's profile window, after the timed steps (each ends in loss.item())
        try:
            with torch.profiler.profile(activities=activities(device.type)) as prof:
                start = time.perf_counter()
                for _ in range(PROFILE_STEPS):
                    one_step()
                seconds = time.perf_counter() - start
            report["profile"] = write_profile(prof, PROFILE_STEPS, seconds, work / "profile-bare", 0, device.type)
        except Exception as err:  # noqa: BLE001 (the timed figures stand; the report misses the profile's)
            report["profile_error"] = f"{type(err).__name__}: {err}"
    print(json.dumps(report))
    return 0


def newton_schulz(wl: Workload, data: dict[str, str], work: Path) -> int:
    """One Muon step's Newton-Schulz iterations alone: every hidden matrix of the model (the shapes Muon
    orthogonalises, gradient-shaped), bf16, 5 iterations each, as ``optim.muon_ns_dtype=bf16`` runs them;
    the median of 3 timed passes after one; prints one JSON line."""
    import torch
    from torch.optim._muon import _zeropower_via_newtonschulz

    from megatransformer.config import load_config
    from megatransformer.model import build_model
    from megatransformer.model.matrices import hidden_matrix_names
    from megatransformer.training.optimizers.muon import NS_COEFFICIENTS, NS_EPS

    cfg = load_config(CONFIG, overrides(wl, data, work / "unused", 1, False))
    with torch.device("meta"):
        model = build_model(cfg.model)
    names = hidden_matrix_names(model)
    shapes = [p.shape for name, p in model.named_parameters() if name in names]
    device = torch.device(wl.device)
    matrices = [torch.randn(shape, device=device, dtype=torch.bfloat16) for shape in shapes]
    steps = cfg.optim.muon_ns_steps
    times = []
    for _ in range(4):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for matrix in matrices:
            _zeropower_via_newtonschulz(matrix, NS_COEFFICIENTS, steps, NS_EPS)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    # one iteration of an m x n matrix (m <= n): ~4 m^2 n + 2 m^3 FLOPs (docs/optimizers.md)
    flops = steps * sum(4 * min(s) ** 2 * max(s) + 2 * min(s) ** 3 for s in shapes)
    ns_s = statistics.median(times[1:])
    print(json.dumps({"ns_s": ns_s, "matrices": len(shapes), "ns_steps": steps, "tflops": flops / ns_s / 1e12}))
    return 0


# ------------------------------------------------------------------------------------------ imports


def wheel_list(mode: str = "core") -> list[str]:
    """The distributions ``bench/gpu_wheels.sh`` brings in ``mode``, as pip names them: core, its CORE array and
    DeepSpeed (what a GPU run installs on an image whose torch is older than 2.13); fa4, its FA4 array too."""
    script = (ROOT / "bench" / "gpu_wheels.sh").read_text()
    names = re.findall(r"^DEEPSPEED=([A-Za-z0-9_.-]+)==", script, re.MULTILINE)
    for array in ("CORE", "FA4") if mode == "fa4" else ("CORE",):
        block = re.search(rf"^{array}=\((.*?)^\)", script, re.MULTILINE | re.DOTALL).group(1)
        names += re.findall(r"^\s+([A-Za-z0-9_.-]+)==", block, re.MULTILINE)
    return [canonical(name) for name in names]


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


# What the GPU machine's image is known to hold (BENCHMARKS.md section 6: its PyTorch, transformers; gpu_check ran
# pytest there, and the trainer's run to its closing curves, drawn with matplotlib since 2026-11-25): these
# distributions and, as installed here, everything they require. Not there: zstandard (its data phase failed).
IMAGE_ROOTS = ("torch", "transformers", "pytest", "pip", "setuptools", "matplotlib")
IMAGE_CUDA = ("triton",)  # what PyTorch's CUDA build requires beyond a CPU build's (read here from a CPU build)


def image_distributions() -> set[str]:
    """``IMAGE_ROOTS`` and their requirements, transitively (extras left out), by the metadata installed here."""
    seen, todo = set(), [canonical(name) for name in IMAGE_ROOTS + IMAGE_CUDA]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in requires:
            if "extra ==" in requirement:
                continue
            todo.append(canonical(re.match(r"[A-Za-z0-9_.-]+", requirement).group(0)))
    return seen


# Imports of the GPU run a dry run cannot make (CUDA-only paths): the distributions that must bring them. flash-attn
# 4's are optional: core mode leaves them out (the project then runs PyTorch's kernels), the fa4 list must bring them.
GPU_ONLY_IMPORTS = {"triton": "triton"}
FA4_IMPORTS = {"flash_attn": "flash-attn-4", "cutlass": "nvidia-cutlass-dsl"}


def allowed_distributions(mode: str = "core") -> set[str]:
    """What the GPU machine has: the image's distributions, the wheel list's (``mode``), and this checkout."""
    return image_distributions() | set(wheel_list(mode)) | {"megatransformer"}


def unmet_requirements(mode: str = "core") -> list[str]:
    """Requirements of the wheel list's distributions (their metadata as installed here; extras and other
    platforms' left out) that neither the image nor the list brings: pip's install there would stop on them."""
    from packaging.requirements import Requirement

    allowed = allowed_distributions(mode)
    unmet = set()
    for name in wheel_list(mode):
        try:
            requires = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue  # (not installed here: read on the GPU machine, by pip)
        for line in requires:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker and not marker.evaluate({"extra": "", "python_version": "3.12", "sys_platform": "linux"}):
                continue
            if canonical(requirement.name) not in allowed:
                unmet.add(f"{canonical(requirement.name)} (required by {name})")
    return sorted(unmet)


def vendored_modules(allowed: set[str]) -> set[str]:
    """Top-level modules an allowed distribution vendors (setuptools puts its ``_vendor`` on sys.path:
    more_itertools, jaraco, ... come with it)."""
    vendored = set()
    for distribution in importlib.metadata.distributions():
        if canonical(distribution.metadata["Name"]) in allowed:
            for file in distribution.files or []:
                parts = file.parts
                if "_vendor" in parts[:-1]:
                    vendored.add(parts[parts.index("_vendor") + 1].removesuffix(".py"))
    return vendored


def blocked_modules() -> list[str]:
    """Top-level modules installed here whose every distribution is neither the image's nor in the wheel list:
    a dry run's processes are refused them (``bench/import_recorder``), as the GPU machine would be."""
    allowed = allowed_distributions()
    owners = importlib.metadata.packages_distributions()
    vendored = vendored_modules(allowed)
    return sorted(
        module
        for module, distributions in owners.items()
        if module not in sys.stdlib_module_names
        and module not in vendored
        and not any(canonical(d) in allowed for d in distributions)
    )


def import_check(modules: set[str]) -> dict:
    """The distributions behind ``modules`` (top-level names the phases' processes imported, plus
    ``GPU_ONLY_IMPORTS``), each in the image or the core wheel list, or ``missing``: it would fail on the GPU machine,
    as would a requirement of the list's distributions that neither brings (:func:`unmet_requirements`);
    ``missing_fa4``: flash-attn 4's imports that the fa4 list lacks. (A dry run's processes cannot import what the
    image and the core list lack at all: ``blocked_modules``.)"""
    owners = importlib.metadata.packages_distributions()
    allowed, wheels = allowed_distributions(), set(wheel_list())
    needed: dict[str, str] = {}
    unowned = []
    for module in sorted(modules):
        distributions = [canonical(d) for d in owners.get(module, [])]
        if distributions:  # (the one that brings it there, else the first)
            needed[module] = next((d for d in distributions if d in allowed), distributions[0])
        elif module not in GPU_ONLY_IMPORTS and module not in FA4_IMPORTS:
            unowned.append(module)
    needed.update(GPU_ONLY_IMPORTS)
    vendored = vendored_modules(allowed)
    missing = sorted({f"{d} (import {m})" for m, d in needed.items() if d not in allowed and m not in vendored})
    with_fa4 = allowed_distributions("fa4")
    return {
        "distributions": sorted(set(needed.values())),
        "from_wheels": sorted(set(needed.values()) & wheels),
        "missing": missing + unmet_requirements(),
        "missing_fa4": sorted(f"{d} (import {m})" for m, d in FA4_IMPORTS.items() if d not in with_fa4),
        "unowned": unowned,  # (site-packages modules without distribution metadata: reported)
    }


def recorded_imports(folder: Path) -> tuple[set[str], dict[str, dict]]:
    """Third-party top-level modules the recorded processes imported, and each process's cache environment."""
    modules, caches = set(), {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path.name == "blocked.json":
            continue
        record = json.loads(path.read_text())
        modules.update(record["modules"])
        caches[record["argv"]] = record["env"]
    return modules, caches


# ------------------------------------------------------------------------------------------ the suite


def gpu_check(wl: Workload, work: Path) -> dict:
    """``bench/gpu_check.py``'s report (dry: its answer on a machine without CUDA, exit 2)."""
    command = [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--out", str(work / "gpu_check")]
    report_file = work / "gpu_check" / "gpu_check.json"
    report_file.unlink(missing_ok=True)  # (an earlier run's, in this --work)
    try:
        done = run_process(command, environment(wl, work), limit(wl, "gpu_check"), work / "logs" / "gpu_check")
    except subprocess.TimeoutExpired as error:  # (with the parts it had finished, written after each)
        finished = json.loads(report_file.read_text()) if report_file.is_file() else {}
        return {**overran(error, "gpu_check"), "finished": finished}
    if report_file.is_file():
        return json.loads(report_file.read_text())
    report = {"ok": wl.device == "cpu" and done.returncode == 2, "exit": done.returncode, "stderr": done.stderr[-2000:]}
    if wl.device == "cpu":  # what its pytest run imports: the gpu tests collected (and recorded) here
        import gpu_check as check

        command = check.gpu_tests_command()
        command.insert(command.index("pytest") + 1, "--collect-only")
        env = dict(environment(wl, work), PYTEST_DISABLE_PLUGIN_AUTOLOAD="1")  # (this machine's plugins are not there)
        collected = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        report["collected"] = collected.returncode == 0
        if not report["collected"]:
            report["collect_output"] = (collected.stdout + collected.stderr)[-3000:]
        report["ok"] = report["ok"] and report["collected"]
    return report


def compare(trainer_run: dict, bare_run: dict) -> dict:
    """The trainer's speed as a fraction of its bare step's (1.0: as fast)."""
    if not (trainer_run.get("ok") and bare_run.get("ok")):
        return {"trainer_over_bare": None}
    return {"trainer_over_bare": bare_run["step_s"] / trainer_run["step_s"]}


def profile_difference(trainer_run: dict, bare_run: dict, rows: int = 12) -> dict | None:
    """The trainer's profiled steps against the bare step's: each one's time a step and its kernels' time, and
    what differs most a step: on a GPU the kernels and copies by their time (an operator's device time repeats
    its kernels'), elsewhere the operators by their self CPU time; one outside a side's top rows counts 0 there."""
    trainer_profile, bare_profile = trainer_run.get("profile"), bare_run.get("profile")
    if not (trainer_profile and bare_profile):
        return None
    on_device = trainer_profile["sorted_by"] == "self_device_time_total"
    key = "self_device_us" if on_device else "self_cpu_us"

    def times(profile: dict) -> dict[str, float]:
        return {row["name"]: row[key] for row in profile["top"] if not on_device or row["on"] != "cpu"}

    trainer_us, bare_us = times(trainer_profile), times(bare_profile)
    names = sorted(trainer_us.keys() | bare_us.keys(), key=lambda n: -abs(trainer_us.get(n, 0) - bare_us.get(n, 0)))
    return {
        "trainer_step_ms": trainer_profile["step_ms"],
        "bare_step_ms": bare_profile["step_ms"],
        "trainer_kernels_ms": trainer_profile["device_busy_ms"],
        "bare_kernels_ms": bare_profile["device_busy_ms"],
        "by": key,
        "difference": [
            {"name": n, "trainer_us": trainer_us.get(n, 0.0), "bare_us": bare_us.get(n, 0.0)} for n in names[:rows]
        ],
    }


def muon_figures(muon_run: dict, ns: dict, adamw_run: dict) -> dict:
    """Muon's step against AdamW's (the rows runs: same data, same steps timed), and Newton-Schulz's share."""
    figures: dict = {"muon_over_adamw": None, "ns_share": None}
    if muon_run.get("ok") and adamw_run.get("ok"):
        figures["muon_over_adamw"] = muon_run["step_s"] / adamw_run["step_s"]
    if muon_run.get("ok") and ns.get("ok"):
        figures["ns_share"] = ns["ns_s"] / muon_run["step_s"]
    return figures


def tp_skip(wl: Workload) -> str | None:
    """Why the tensor-parallel phase cannot run here, or None (dry runs take gloo's CPU ranks)."""
    if wl.device != "cuda":
        return None
    import torch

    gpus = torch.cuda.device_count()
    if gpus >= TP:
        return None
    return (
        f"needs {TP} GPUs, this machine has {gpus}: NCCL runs one rank per GPU, and at tensor_parallel=1 DeepSpeed "
        "applies no AutoTP (no sharded layer, no all_reduce for dynamo to trace): nothing of it to check on one"
    )


def versions() -> dict:
    import torch

    from megatransformer.model import gpu_cores
    from megatransformer.model.attention import flash_attn_module

    flash = flash_attn_module()
    cuda = torch.cuda.is_available()
    return {
        "device": torch.cuda.get_device_name() if cuda else "cpu (dry run)",
        "gpus": torch.cuda.device_count() if cuda else 0,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "deepspeed": importlib.metadata.version("deepspeed"),
        "flash_attn": None if flash is None else flash.__version__,
        "flash_registry": {core: gpu_cores.registry_impl_installed(core) for core in gpu_cores.REGISTRY_IMPLS},
        "flash_registry_torch": {core: gpu_cores.torch_refusal(core) for core in gpu_cores.REGISTRY_IMPLS},
        "date": datetime.date.today().isoformat(),
        # every distribution installed (the image's and the wheels'): what IMAGE_ROOTS infers, read from the machine
        "installed": sorted(
            {f"{canonical(d.metadata['Name'])}=={d.version}" for d in importlib.metadata.distributions()}
        ),
    }


NOT_RUN = {"ok": False, "not_run": True}  # a phase's place in the report until it has run


def new_report(wl: Workload, work: Path, disk: str) -> dict:
    """The report before any phase has run."""
    report: dict = {"ok": False, "work": str(work), "disk": disk, "workload": dataclasses.asdict(wl)}
    report.update(limits_s=LIMITS_S, phases_s={}, gpu_check=dict(NOT_RUN), data=dict(NOT_RUN))
    for mode in MODES:
        report[mode] = {"trainer": dict(NOT_RUN), "bare": dict(NOT_RUN)}
    report["muon"] = {"trainer": dict(NOT_RUN), "ns": dict(NOT_RUN)}
    report["zero3"] = {"trainer": dict(NOT_RUN)}
    report["tp"] = {"trainer": dict(NOT_RUN)}
    return report


def summarise(report: dict) -> None:
    """The figures that follow from the phases' results so far: the ratios, the total time, ok, what is missing."""
    for mode in MODES:
        report[mode].update(compare(report[mode]["trainer"], report[mode]["bare"]))
    report[PROFILED]["profile"] = profile_difference(report[PROFILED]["trainer"], report[PROFILED]["bare"])
    muon = report["muon"]
    muon.update(muon_figures(muon["trainer"], muon["ns"], report["rows"]["trainer"]))
    report["total_s"] = round(sum(report["phases_s"].values()), 1)
    sides = [report[mode][side] for mode in MODES for side in ("trainer", "bare")]
    sides += [muon["trainer"], muon["ns"], report["zero3"]["trainer"]]
    sides += [] if "skipped" in report["tp"] else [report["tp"]["trainer"]]
    report["ok"] = (
        (bool(report["gpu_check"].get("ok")) or "skipped" in report["gpu_check"])
        and all(side.get("ok") for side in sides)
        and not report.get("imports", {}).get("missing")
        and not report.get("imports", {}).get("missing_fa4")
        and "error" not in report
    )
    report["missing"] = missing_figures(report)


def write_report(report: dict, out: Path) -> str:
    """``gpu_suite.json`` and ``gpu_suite.md`` in ``out`` from the report as it stands, each replaced whole (a suite
    killed while writing leaves the previous ones); returns the Markdown."""
    summarise(report)
    markdown = table(report)
    for name, text in (("gpu_suite.json", json.dumps(report, indent=2)), ("gpu_suite.md", markdown)):
        partial = out / f"{name}.partial"
        partial.write_text(text + "\n")
        partial.replace(out / name)
    return markdown


def run_suite(wl: Workload, work: Path, out: Path, disk: str = "", skip_gpu_check: bool = False) -> dict:
    """Every phase in turn (gpu_check not where ``skip_gpu_check``); the report is written to ``out`` after each one,
    and after an exception with what is known by then (the exception goes on)."""
    report = new_report(wl, work, disk)

    def phase(name: str, call, *place: str) -> dict:
        """One phase: its result put at ``report[place[0]][place[1]]...``, its time recorded, the report written."""
        started = time.perf_counter()
        try:
            result = call()
            target = report
            for key in place[:-1]:
                target = target[key]
            target[place[-1]] = result
            return result
        finally:
            report["phases_s"][name] = round(time.perf_counter() - started, 1)
            print(f"# {name}: {report['phases_s'][name]} s", flush=True)
            write_report(report, out)

    try:
        report["versions"] = versions()
        skip = tp_skip(wl)
        if skip is not None:
            report["tp"] = {"skipped": skip}
        write_report(report, out)
        if wl.device == "cpu":  # (dry: every process as on the GPU image, bench/import_recorder)
            (work / "imports").mkdir(parents=True, exist_ok=True)
            (work / "imports" / "blocked.json").write_text(json.dumps(blocked_modules()))
        if skip_gpu_check:
            report["gpu_check"] = {"skipped": "--skip-gpu-check"}
        else:
            phase("gpu_check", lambda: gpu_check(wl, work), "gpu_check")
        data = phase("data", lambda: data_phase(wl, work), "data").get("paths")
        if data:  # (else nothing to train on)
            for mode in MODES:
                profile = PROFILE_STEPS if mode == PROFILED else 0
                steps = wl.e2e_steps if mode == "packed" else wl.warmup + wl.steps + profile
                run = Run(f"trainer-{mode}", mode, steps, save=mode == "packed", profile=profile)  # (save: the one)
                phase(run.phase, lambda run=run: trainer(wl, run, data[run.mode], work), mode, "trainer")
                phase(f"bare-{mode}", lambda mode=mode: bare(wl, mode, data[mode], work), mode, "bare")
            muon = Run("trainer-muon", "rows", wl.warmup + wl.muon_steps, extra=("optim.name=muon",))
            phase(muon.phase, lambda: trainer(wl, muon, data["rows"], work), "muon", "trainer")
            phase("muon-ns", lambda: bare(wl, "muon-ns", data["rows"], work, phase="muon-ns"), "muon", "ns")
            zero3 = Run("trainer-zero3", "rows", wl.warmup + wl.steps // 2, extra=("parallel.zero_stage=3",))
            phase(zero3.phase, lambda: trainer(wl, zero3, data["rows"], work), "zero3", "trainer")
            if skip is None:
                tp = Run("trainer-tp", "rows", wl.warmup + wl.steps // 2, extra=(f"parallel.tensor_parallel={TP}",))
                tp = dataclasses.replace(tp, nproc=TP, tp=TP)
                phase(tp.phase, lambda: trainer(wl, tp, data["rows"], work), "tp", "trainer")
        if wl.device == "cpu":  # (the recorder runs in dry runs only)
            modules, caches = recorded_imports(work / "imports")
            report["imports"] = {**import_check(modules), "processes": len(caches)}
            report["caches"] = sorted({json.dumps(env, sort_keys=True) for env in caches.values()})
    except BaseException:
        report["error"] = traceback.format_exc()[-3000:]
        raise
    finally:
        write_report(report, out)
    return report


def missing_figures(report: dict) -> list[str]:
    """The figures a complete report holds that this one lacks (None or absent)."""
    wanted = [f"{mode}.{side}.{key}" for mode in MODES for side in ("trainer", "bare") for key in ("step_s", "mfu")]
    wanted += [f"{mode}.{side}.compile.recompiles" for side in ("trainer", "bare") for mode in MODES]
    wanted += [f"{mode}.trainer_over_bare" for mode in MODES]
    wanted += [
        "packed.trainer.checkpoints.0.stall_s",
        "packed.trainer.checkpoints.0.gib",
        "packed.bare.documents_per_row",
    ]
    wanted += [f"{PROFILED}.profile.trainer_step_ms", f"{PROFILED}.profile.bare_step_ms"]
    wanted += ["muon.trainer.step_s", "muon.ns.ns_s", "muon.muon_over_adamw", "muon.ns_share"]
    wanted += ["zero3.trainer.step_s", "zero3.trainer.compile.recompiles", "zero3.trainer.compile.graph_breaks"]
    wanted += (
        ["tp.skipped"]
        if "skipped" in report.get("tp", {})
        else ["tp.trainer.step_s", "tp.trainer.compile.graph_breaks"]
    )
    missing = []
    for path in wanted:
        value = report
        for key in path.split("."):
            if isinstance(value, list):
                value = value[int(key)] if key.isdigit() and int(key) < len(value) else None
            else:
                value = value.get(key) if isinstance(value, dict) else None
        if value is None:
            missing.append(path)
    return missing


def table(report: dict) -> str:
    """The report as Markdown: one row per run, then the checkpoint, Muon, tensor parallelism, the phases."""

    def number(value, form: str) -> str:
        return "-" if value is None else format(value, form)

    def state(run: dict) -> str:
        if run.get("ok"):
            return ""
        return " (timed out)" if run.get("timed_out") else " (not run)" if run.get("not_run") else " (failed)"

    versions = report.get("versions", {})
    rows = [
        f"GPU suite, {versions.get('device')}, torch {versions.get('torch')} ({versions.get('date')})",
        "",
        "| workload | runner | step s | tokens/s | MFU | recompiles | graph breaks | trainer / bare |",
        "|---|---|---|---|---|---|---|---|",
    ]
    runs = [(mode, side, report[mode][side]) for mode in MODES for side in ("trainer", "bare")]
    runs += [("rows, muon", "trainer", report["muon"]["trainer"])]
    runs += [("rows, ZeRO-3", "trainer", report["zero3"]["trainer"])]
    runs += [] if "skipped" in report["tp"] else [(f"rows, tp {TP}", "trainer", report["tp"]["trainer"])]
    for mode, side, r in runs:
        c = r.get("compile", {})
        ratio = number(report[mode].get("trainer_over_bare"), ".3f") if mode in MODES and side == "trainer" else ""
        mfu = None if r.get("mfu") is None else 100 * r["mfu"]
        rows.append(
            f"| {mode} | {side}{state(r)} | {number(r.get('step_s'), '.4f')} | {number(r.get('tokens_per_s'), ',.0f')} "
            f"| {number(mfu, '.1f')}% | {number(c.get('recompiles'), 'd')} | {number(c.get('graph_breaks'), 'd')} "
            f"| {ratio} |"
        )
    rows.append("")
    [save, *_] = report["packed"]["trainer"].get("checkpoints") or [{}]
    rows.append(
        f"- checkpoint (the suite's one, packed run, step {save.get('step')}): stall "
        f"{number(save.get('stall_s'), '.2f')} s (setting up {number(save.get('setup_s'), '.2f')} s: the first "
        f"save's), background write {number(save.get('write_s'), '.2f')} s, "
        f"{number(save.get('gib'), '.2f')} GiB"
    )
    profiled = report[PROFILED].get("profile")
    if profiled:
        kernels = {side: profiled[f"{side}_kernels_ms"] for side in ("trainer", "bare")}
        on_device = {side: "" if ms is None else f" (kernels {ms:.1f} ms)" for side, ms in kernels.items()}
        most = ", ".join(
            f"{d['name']} {(d['trainer_us'] - d['bare_us']) / 1e3:+.2f} ms" for d in profiled["difference"][:5]
        )
        rows.append(
            f"- profile ({PROFILED}, {PROFILE_STEPS} steps after the timed ones): trainer "
            f"{profiled['trainer_step_ms']:.1f} ms a step{on_device['trainer']}, bare {profiled['bare_step_ms']:.1f} ms"
            f"{on_device['bare']}; most different ({profiled['by']}, trainer - bare): {most}"
        )
    muon = report["muon"]
    rows.append(
        f"- Muon: step {number(muon['trainer'].get('step_s'), '.4f')} s = "
        f"{number(muon.get('muon_over_adamw'), '.2f')}x AdamW's; Newton-Schulz (bf16, "
        f"{muon['ns'].get('matrices', '-')} matrices) {number(muon['ns'].get('ns_s'), '.4f')} s = "
        f"{number(muon.get('ns_share'), '.1%')} of the step, {number(muon['ns'].get('tflops'), '.1f')} TFLOP/s"
    )
    if "skipped" in report["tp"]:
        rows.append(f"- tensor parallelism: skipped: {report['tp']['skipped']}")
    check = report["gpu_check"]
    check_state = f"skipped ({check['skipped']})" if "skipped" in check else f"ok: {check.get('ok')}"
    rows.append(f"- gpu_check {check_state}; data ok: {report['data'].get('ok')} {report['data'].get('seconds', '')}")
    rows.append(f"- phases (s): {report['phases_s']} (total {report['total_s']} s)")
    if "imports" in report:
        imports = report["imports"]
        rows.append(f"- imports: missing from the image and the wheels: {imports['missing'] or 'none'}")
    if "error" in report:
        rows.append(f"- stopped by an error: {report['error'].strip().splitlines()[-1]}")
    return "\n".join(rows)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help="gpu_suite.json and gpu_suite.md (default: the work dir)")
    p.add_argument("--work", type=Path, default=None, help="data, runs and compile caches (default: a new /tmp dir)")
    p.add_argument("--dry", action="store_true", help="on the CPU with a tiny model: checks the bookkeeping")
    p.add_argument(
        "--limit",
        action="append",
        default=[],
        metavar="PHASE=S",
        help=f"a phase's time limit; phases: {list(LIMITS_S)}",
    )
    p.add_argument(
        "--skip-gpu-check",
        action="store_true",
        help="leave gpu_check out (a second call of one session, where the first one's passed): its time to the rest",
    )
    p.add_argument("--worker", choices=[*MODES, "muon-ns"], help=argparse.SUPPRESS)  # the bare step of one mode
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for limit in args.limit:
        phase, _, seconds = limit.partition("=")
        if phase not in LIMITS_S or not seconds.isdigit():
            p.error(f"--limit {limit}: give PHASE=SECONDS, PHASE one of {list(LIMITS_S)}")
        LIMITS_S[phase] = int(seconds)
    if args.out is not None and args.work is not None and args.work.resolve().is_relative_to(args.out.resolve()):
        p.error(f"--work {args.work} is inside --out {args.out}: keep the work (checkpoints, caches) outside it")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wl = DRY if args.dry else GPU
    if args.worker:
        call = newton_schulz if args.worker == "muon-ns" else functools.partial(worker, mode=args.worker)
        return call(wl, data=json.loads(args.data), work=args.work)
    import torch

    if not args.dry and not torch.cuda.is_available():
        print("gpu_suite: error: no CUDA device here; run it on a GPU machine, or --dry on a CPU", file=sys.stderr)
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu_suite-", dir="/tmp"))
    out = args.out or work
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    disk = subprocess.run(["df", "-h", str(work)], capture_output=True, text=True).stdout
    print(disk, end="", flush=True)  # (the packed run's checkpoint takes ~15 GB of it)
    report = run_suite(wl, work, out, disk, skip_gpu_check=args.skip_gpu_check)
    print(table(report))
    print(f"# report: {out / 'gpu_suite.json'}, {out / 'gpu_suite.md'}; work: {work}")
    if report["missing"]:
        print(f"# missing figures: {', '.join(report['missing'])}")
    return 0 if report["ok"] and not report["missing"] else 1


if __name__ == "__main__":
    sys.exit(main())
