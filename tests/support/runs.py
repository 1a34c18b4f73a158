"""Real ``megatransformer`` processes: the CLI, training runs on one or more ranks, and the files a run writes."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from support import REPO
from support.forked_cli import ForkedCli

# The tiny decoder most end-to-end runs train; the tensor-parallel degree 2 divides heads, kv heads, d_ff and the
# vocabulary (512: tiny_data's tokenizer).
TINY_MODEL = {
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "d_ff": 96,
    "vocab_size": 512,
    "max_seq_len": 128,
}
# One intra-op thread a process: ranks (or concurrent processes) on two shared cores spin-wait badly with more.
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
CLI = [sys.executable, "-m", "megatransformer.cli"]
# runs forked from a server that has imported the trainer (support/forked_cli.py), where the environment allows
FORKED = ForkedCli()


def tiny_model(**fields: object) -> list[str]:
    """The tiny decoder as ``model.*`` overrides, with ``fields`` changed (None: left to the config's default)."""
    return [f"model.{key}={value}" for key, value in (TINY_MODEL | fields).items() if value is not None]


def tiny_data_overrides(tiny_data) -> list[str]:
    """The overrides that read the tiny_data fixture's shards with its tokenizer."""
    return [f"data.train={tiny_data.shards}", f"data.tokenizer={tiny_data.tokenizer}"]


# The short run's settings beyond the model, the run directory and the data, in the order of its overrides
# (None: left to the config's default); no closing plot (tests/e2e/test_console_run.py checks it).
TINY_RUN = {
    "data.seq_len": "64",
    "train.micro_batch_size": "4",
    "train.grad_accum": "2",
    "train.global_batch_size": None,
    "train.max_steps": "8",
    "train.log_every": "1",
    "train.eval_every": None,
    "train.eval_batches": "2",
    "optim.lr": "3e-3",
    "schedule.warmup_steps": "2",
    "checkpoint.every": "4",
    "checkpoint.keep": None,
    "wandb.mode": "disabled",
    "train.plot": "false",
}


def tiny_run(tiny_data, run_dir: Path, steps: int = 8, changes: dict[str, object] | None = None) -> list[str]:
    """The overrides of a short run of the tiny decoder on tiny_data: micro batch 4 x accumulation 2 of 64
    tokens, a log line every step, a checkpoint every 4; ``changes``: other values of TINY_RUN's keys."""
    settings = TINY_RUN | {"train.max_steps": steps} | (changes or {})
    return [
        *tiny_model(),
        f"run_dir={run_dir}",
        *tiny_data_overrides(tiny_data),
        *(f"{key}={value}" for key, value in settings.items() if value is not None),
    ]


def resumable_run(saved: int, micro: int, global_batch: int) -> dict[str, object]:
    """tiny_run's changes for a run that checkpoints at step ``saved`` and is resumed on other layouts: a global
    batch of ``global_batch`` rows (the accumulation follows from the data-parallel size), no validation
    before the end."""
    return {
        "train.micro_batch_size": micro,
        "train.grad_accum": None,
        "train.global_batch_size": global_batch,
        "train.eval_every": 0,
        "train.eval_batches": 1,
        "checkpoint.every": saved,
    }


# A four-step run of a one-layer decoder at 32 tokens: a log line every 2 steps, validation at step 3 and at the
# end (run directory and data to add).
FOUR_STEPS = [
    *tiny_model(n_layers=1, n_kv_heads=None, max_seq_len=64),
    "data.seq_len=32",
    "train.micro_batch_size=2",
    "train.grad_accum=1",
    "train.max_steps=4",
    "train.log_every=2",
    "train.eval_every=3",
    "train.eval_batches=1",
    "train.plot=false",
]


def checkpoint(run_dir: Path, step: int) -> Path:
    """The directory of ``run_dir``'s checkpoint of ``step``."""
    return run_dir / "checkpoints" / f"step_{step:06d}"


def cli(*args: object, check: bool = True, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``megatransformer ARGS`` in a new process (forked where the environment allows: FORKED); with ``check``, an
    error unless it exits 0."""
    env = {**os.environ, **(env or {})}
    if FORKED.serves(env):
        result = FORKED.run([*map(str, args)], env=env)
    else:
        result = subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, env=env)
    if check and result.returncode != 0:
        raise AssertionError(f"megatransformer {' '.join(map(str, args))} failed:\n{result.stdout}\n{result.stderr}")
    return result


def torchrun(nproc: int) -> list[str]:
    """``python -m torch.distributed.run`` with ``nproc`` processes on this machine (a module or script follows)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]


def launch_command(nproc: int = 2) -> list[str]:
    """``python -m launch`` under torchrun with ``nproc`` processes (its arguments follow)."""
    return [*torchrun(nproc), "-m", "launch"]


def train_command(nproc: int = 1) -> list[str]:
    """``megatransformer train`` with no config file (overrides follow): one process, or torchrun's ``nproc``."""
    launcher = torchrun(nproc) if nproc > 1 else [sys.executable]
    return [*launcher, "-m", "megatransformer.cli", "train", "--config", os.devnull]


def train(
    overrides: list[str], nproc: int = 1, expect: int | None = 0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """A training run to its end; an error unless it exits ``expect`` (None: the caller checks). Forked (FORKED)
    where the environment allows, but for a run of several ranks expected to fail: its exit code and messages are
    torchrun's."""
    env = {**os.environ, **(env or {})}
    if (nproc == 1 or expect == 0) and FORKED.serves(env):
        result = FORKED.run(["train", "--config", os.devnull, *overrides], nproc=nproc, timeout=600, env=env)
    else:
        result = subprocess.run(train_command(nproc) + overrides, capture_output=True, text=True, env=env, timeout=600)
    if expect is not None and result.returncode != expect:
        raise AssertionError(
            f"exit {result.returncode} (expected {expect})\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
        )
    return result


class SharedRun(NamedTuple):
    """A finished run several tests read: its directory (read only: copy it to resume it or change it) and its
    standard output."""

    run_dir: Path
    stdout: str


class SharedRuns:
    """Training runs made once per session for every test that reads the same one (a reference that several tests
    or parametrizations compare with): a run is known by its overrides, rank count and environment, and trains the
    first time a test asks for it, so that each test still runs alone."""

    def __init__(self, root: Path) -> None:
        self._root = root
        self._made: dict[tuple, SharedRun] = {}
        self._started = itertools.count()

    def train(
        self, overrides: Callable[[Path], list[str]], nproc: int = 1, env: dict[str, str] | None = None
    ) -> SharedRun:
        """The run of ``overrides(run_dir)`` on ``nproc`` ranks, trained to its end (exit 0) the first time; a run
        that failed is tried again, in a new directory, by the next test that asks for it."""
        key = (tuple(overrides(Path("<run_dir>"))), nproc, tuple(sorted((env or {}).items())))
        if key not in self._made:
            run_dir = self._root / f"run_{next(self._started):03d}"
            self._made[key] = SharedRun(run_dir, train(overrides(run_dir), nproc=nproc, env=env).stdout)
        return self._made[key]


def kill_when(path: Path, overrides: list[str], nproc: int = 1) -> None:
    """``megatransformer train`` on ``nproc`` ranks, killed with SIGKILL as soon as ``path`` exists (the launcher's
    process group; torchrun's ranks, each in a session of its own, end with it), returning once every rank has
    ended; an error if the run ends before."""
    process = subprocess.Popen(
        train_command(nproc) + overrides, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        while not path.exists():
            assert process.poll() is None, f"the run ended (exit {process.returncode}) before {path} was written"
            time.sleep(0.01)
    finally:
        ranks = children(process.pid)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        deadline = time.monotonic() + 60
        while any(alive(pid) for pid in ranks):
            assert time.monotonic() < deadline, f"ranks {ranks} outlived their killed launcher"
            time.sleep(0.05)


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid`` (Linux)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            if int(stat.read_text().rsplit(") ", 1)[1].split()[1]) == pid:
                found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie has ended: its locks and files are released)."""
    try:
        return not Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")
    except OSError:
        return False


def free_port() -> str:
    """A free port on this machine, as MASTER_PORT takes it."""
    from megatransformer.training.runtime.distributed import free_port

    return str(free_port())


def thread_names() -> list[str]:
    """The names of this process's threads, sorted (Linux)."""
    return sorted(Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in os.listdir("/proc/self/task"))


def spawn_ranks(
    overrides: list[str], log: Path, world: int = 2, command: list[str] | None = None
) -> list[subprocess.Popen]:
    """``world`` training ranks started directly with RANK / WORLD_SIZE / MASTER_* in their environment (as srun
    does), so that each rank's pid and exit code are the caller's; rank r writes to ``{log}.rank{r}.log``.
    ``command``: instead of ``megatransformer train``'s, followed by the overrides."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            **ONE_THREAD,
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }
        with open(f"{log}.rank{rank}.log", "a") as out:
            argv = (command or train_command()) + overrides
            procs.append(subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT))
    return procs


def wait_ranks(procs: list[subprocess.Popen], log: Path, timeout: float = 300) -> list[int]:
    """The exit codes of ranks started by spawn_ranks; ranks still running after ``timeout`` s are killed."""
    try:
        return [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        raise AssertionError(f"ranks did not finish in {timeout} s; see {log}.rank*.log") from None


def wait_for_step(run_dir: Path, step: int, procs: list[subprocess.Popen], log: Path | None = None) -> None:
    """Until ``run_dir/metrics.jsonl`` has a record of ``step`` or later; an error (with the end of ``log``)
    as soon as one of ``procs`` ends before."""
    path = run_dir / "metrics.jsonl"
    while not (
        path.is_file()
        and any(json.loads(line).get("step", 0) >= step for line in path.read_text().splitlines() if line.endswith("}"))
    ):
        ended = [p.returncode for p in procs if p.poll() is not None]
        if ended:
            tail = log.read_text()[-3000:] if log else ""
            raise AssertionError(f"a process ended (exit {ended[0]}) before step {step}\n{tail}")
        time.sleep(0.02)


def wait_for_checkpoint(run_dir: Path, procs: list[subprocess.Popen]) -> None:
    """Until ``run_dir`` has a complete checkpoint (its ``latest``: a save written in the background is named there
    once complete); an error as soon as one of ``procs`` ends before."""
    latest = run_dir / "checkpoints" / "latest"
    while not latest.is_file():
        ended = [p.returncode for p in procs if p.poll() is not None]
        if ended:
            raise AssertionError(f"a process ended (exit {ended[0]}) before its first checkpoint was complete")
        time.sleep(0.02)


def metrics(run_dir: Path) -> list[dict]:
    """The records of ``run_dir/metrics.jsonl`` but the checkpoints' timings (:func:`checkpoint_records`),
    which differ from run to run."""
    return [r for r in all_metrics(run_dir) if r.get("kind") != "checkpoint"]


def checkpoint_records(run_dir: Path) -> list[dict]:
    """One record per finished save: ckpt_stall_s, ckpt_setup_s, ckpt_write_s, ckpt_bytes."""
    return [r for r in all_metrics(run_dir) if r.get("kind") == "checkpoint"]


def all_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[float]:
    """The training losses of ``run_dir``, step by step."""
    return [r["loss"] for r in metrics(run_dir) if "loss" in r]


def losses_by_step(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics(run_dir) if "loss" in r}


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any launcher's (torchrun, Slurm) variables, plus ``extra``."""
    drop = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("SLURM_")}
    return env | extra


def write_tiny_config(path: Path, tiny_data, run_dir: Path, **train: int) -> Path:
    """A ~20k-parameter decoder, ZeRO-2, that trains a step in milliseconds on CPU."""
    cfg = {
        "run_dir": str(run_dir),
        "seed": 0,
        "model": {
            "arch": "decoder",
            "d_model": 32,
            "n_layers": 1,
            "n_heads": 2,
            "n_kv_heads": 1,
            "d_ff": 64,
            "vocab_size": 512,
            "max_seq_len": 32,
            "norm": "rmsnorm",
            "position": "rope",
            "ffn": "swiglu",
            "tie_embeddings": True,
        },
        "data": {
            "train": str(tiny_data.shards),
            "tokenizer": str(tiny_data.tokenizer),
            "seq_len": 32,
            "shuffle_buffer": 50,
        },
        "objective": "autoregressive",
        "train": {
            "max_steps": 6,
            "micro_batch_size": 2,
            "grad_accum": 1,
            "log_every": 1,
            "eval_batches": 1,
            "peak_tflops": 1.0,
        }
        | train,
        "optim": {"lr": 1.0e-3},
        "schedule": {"name": "constant", "warmup_steps": 0},
        "checkpoint": {"every": 3},
        "parallel": {"zero_stage": 2},
        "wandb": {"mode": "disabled"},
    }
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def run_launch(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    """``python -m launch ARGS`` from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "launch", *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout
    )


def trainer_state_record(**changes) -> dict:
    """A checkpoint's trainer.json record (step 40 of a one-rank ZeRO-0 run, no tokenizer hash), with ``changes``."""
    return {
        "step": 40,
        "tokens": 1,
        "bad_steps": 0,
        "tokenizer_sha256": None,
        "world_size": 1,
        "tensor_parallel": 1,
        "zero_stage": 0,
    } | changes
