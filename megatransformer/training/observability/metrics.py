"""What a run reports: metrics.jsonl, W&B, TensorBoard, and the console. Rank 0 only.

The console prints a line per metrics.jsonl record, made from that record (so the two always agree), a
progress bar on a terminal, and a closing summary; DeepSpeed's start-up chatter is held back unless asked for.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from data_pipeline import write_failed
from megatransformer.config import ConfigError, RunConfig, precision_dtype
from megatransformer.console import to_stderr
from megatransformer.planner import GPUS
from megatransformer.training.observability.trackers import TensorBoard, unreachable

if TYPE_CHECKING:  # (torch is imported where it is used: the CLI starts without it)
    import torch

# Dense (no sparsity) bf16 = fp16 tensor-core peaks per GPU, TFLOP/s: the planner's table (planner.GPUS, from
# NVIDIA's datasheets). The first name contained in torch.cuda.get_device_name() wins, so the more specific names
# come first. fp32 runs are measured against TF32, half of these.
GPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = tuple((gpu.name, gpu.peak_tflops) for gpu in GPUS)


def finite_or_none(value: float | None) -> float | None:
    """A number for metrics.jsonl: None where non-finite (JSON has no NaN)."""
    return value if value is not None and math.isfinite(value) else None


def gpu_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """A known GPU's dense peak for ``dtype`` (bf16/fp16; fp32 as TF32), or None for a GPU not in the table."""
    import torch

    for name, peak in GPU_PEAK_TFLOPS:
        if name in device_name:
            return peak if dtype in (torch.bfloat16, torch.float16) else peak / 2
    return None


def peak_tflops(cfg: RunConfig, device: str) -> float | None:
    """Per-device peak for the MFU estimate: train.peak_tflops, else a known GPU, else a measured matmul peak
    on a GPU. None on a CPU without train.peak_tflops: a CPU's matmul speed moves with its load, clock and
    kernel choice (a start-up measurement gave MFUs of 6-99% within one run), so no MFU is shown there."""
    import torch

    if cfg.train.peak_tflops:
        return cfg.train.peak_tflops
    if not device.startswith("cuda"):
        return None
    dtype = precision_dtype(cfg.precision)
    known = gpu_peak_tflops(torch.cuda.get_device_name(device), dtype)
    if known is not None:
        return known
    a = torch.randn(4096, 4096, device=device, dtype=dtype)
    a @ a
    torch.cuda.synchronize()
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < 0.2:
        a @ a
        n += 1
    torch.cuda.synchronize()
    return 2 * 4096**3 * n / (time.perf_counter() - started) / 1e12


def truncate_metrics(path: Path, after_step: int, rollbacks: int = 0) -> None:
    """On resume, drop lines of steps after the checkpoint: they are re-run and logged again. Loss-spike
    events of a trajectory an earlier rollback left (fewer than ``rollbacks`` before them) stay: their steps
    are not run again.

    A last line that is not JSON is a write the previous run did not finish (killed mid-line): dropped with
    a warning. A bad line anywhere else is not from an interrupted write: an error naming the line."""
    if not path.is_file():
        return
    lines = path.read_text(errors="replace").splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if number == len(lines):
                to_stderr(
                    f"warning: {path}: the last line ({line[:40]!r}...) is cut short (an interrupted write); dropped",
                )
                continue
            raise ConfigError(
                f"{path} line {number} is not JSON ({line[:40]!r}); remove or fix that line to resume"
            ) from None
        if record.get("step", 0) <= after_step or record.get("rollbacks", rollbacks) < rollbacks:
            kept.append(line)
    from megatransformer.checkpoint import atomic_write

    try:
        atomic_write(path, "".join(line + "\n" for line in kept))
    except OSError as err:
        raise write_failed(f"rewriting {path}", path.parent, err, "it is unchanged") from None


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One line onto metrics.jsonl, whole or not at all: a write that fails (a full disk) is cut back off, and
    raised as WriteFailed."""
    size = path.stat().st_size if path.exists() else 0
    try:
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")
    except OSError as err:
        with contextlib.suppress(OSError):
            os.truncate(path, size)
        raise write_failed(
            f"writing {path}", path.parent, err, "its earlier lines and the checkpoints are intact (resume=auto)"
        ) from None


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run directory's metrics.jsonl."""
    from megatransformer.config import ConfigError

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{run_dir} has no metrics.jsonl (is it a run directory?)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Reporter:
    """Writes metrics.jsonl, W&B and TensorBoard, and shows every record on the console as it is written.

    ``tracker_config`` is what W&B records as the run's config (the resolved config and the run's facts)."""

    def __init__(
        self,
        cfg: RunConfig,
        is_main: bool,
        start_step: int,
        tracker_config: dict[str, Any] | None = None,
        rollbacks: int = 0,
    ) -> None:
        self.cfg, self.is_main = cfg, is_main
        self.path = Path(cfg.run_dir) / "metrics.jsonl"
        self.bar = None
        self.wandb = None
        self.tensorboard = None
        self._started, self._start_step = time.perf_counter(), start_step
        if not is_main:
            return
        truncate_metrics(self.path, start_step, rollbacks)
        self.wandb = start_wandb(cfg, tracker_config)  # (first: its warning on a line of its own, not the bar's)
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.max_steps, initial=start_step, unit="step", dynamic_ncols=True)
        if cfg.tensorboard:
            self.tensorboard = TensorBoard(cfg.run_dir, start_step)

    def log(self, record: dict[str, Any]) -> None:
        """Write a training record (it has ``loss``) or a validation record (``val_loss`` and / or
        ``eval/<task>/<metric>``), stamped with its ``kind`` (train / valid) and wall-clock ``time`` (Unix
        seconds)."""
        if not self.is_main:
            return
        evaluation = "val_loss" in record or any(key.startswith(EVAL_PREFIX) for key in record)
        record = {
            "step": record["step"],
            "kind": "valid" if evaluation else "train",
            "time": round(time.time(), 3),
            **record,
        }
        append_record(self.path, record)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k not in ("step", "kind", "time")}, step=record["step"])
        if self.tensorboard is not None:
            self.tensorboard.log(record)
        if "loss" in record:
            self.message(self.train_line(record))
        if evaluation:
            self.message(validation_line(record))

    def log_save(self, step: int, stall_s: float, setup_s: float, write_s: float, size: int) -> None:
        """A finished checkpoint: metrics.jsonl (``kind`` checkpoint: ``ckpt_stall_s``, the step's wait for the
        copy to host memory, ``ckpt_setup_s`` of it what a run's first save sets up; ``ckpt_write_s``, the
        background write; ``ckpt_bytes``, every rank's files) and a log line."""
        if not self.is_main:
            return
        record = {
            "step": step,
            "kind": "checkpoint",
            "time": round(time.time(), 3),
            "ckpt_stall_s": round(stall_s, 4),
            "ckpt_setup_s": round(setup_s, 4),
            "ckpt_write_s": round(write_s, 4),
            "ckpt_bytes": size,
        }
        append_record(self.path, record)
        setup = f" ({setup_s:.3f} s of it setting up the saves: host memory, the writers' group)"
        setup = setup if round(setup_s, 3) else ""  # (a run's first save)
        self.message(
            f"checkpoint step {step}: {size / 2**20:,.1f} MiB written in {write_s:.2f} s in the background; "
            f"training stalled {stall_s:.3f} s{setup}"
        )

    def event(self, record: dict[str, Any], line: str) -> None:
        """A loss-spike event: metrics.jsonl (``kind`` spike), its console ``line``, W&B (an alert for a
        rollback or a stop where W&B is online)."""
        if not self.is_main:
            return
        record = {"step": record["step"], "kind": "spike", "time": round(time.time(), 3), **record}
        append_record(self.path, record)
        self.message(line)
        if self.wandb is not None:
            points = ("spike_loss", "threshold", "spike_grad_norm", "grad_norm_threshold")
            self.wandb.log(
                {f"spikes/{key.removeprefix('spike_')}": record[key] for key in points if record.get(key) is not None},
                step=record["step"],
            )
            if record["event"] != "skip" and wandb_mode(self.cfg) == "online":
                self.wandb.alert(title=f"loss spike: {record['event']}", text=line)

    def rewind(self, step: int, rollbacks: int) -> None:
        """After a rollback to ``step``: the steps after it are run again (and logged again)."""
        if self.is_main:
            truncate_metrics(self.path, step, rollbacks)

    def train_line(self, record: dict[str, Any]) -> str:
        """A training record as one line: its own numbers, plus the ETA at the run's average pace so far."""
        step, total = record["step"], self.cfg.train.max_steps
        loss = "nan" if record["loss"] is None else f"{record['loss']:.4f}"
        pace = (time.perf_counter() - self._started) / max(step - self._start_step, 1)
        mfu = "" if record.get("mfu") is None else f" | MFU {record['mfu']:.2%}"
        z_loss = ""
        if "z_loss" in record:
            z_loss = " | z-loss " + ("nan" if record["z_loss"] is None else f"{record['z_loss']:.3g}")
        return (
            f"step {step}/{total} | loss {loss}{z_loss} | lr {record['lr']:.3g} | {record['tokens_per_s']:,.0f} tok/s"
            f"{mfu} | ETA {format_duration((total - step) * pace)}"
        )

    def progress(self, step: int) -> None:
        """Moves the progress bar (on a terminal); the numbers are shown per log interval by :meth:`log`."""
        if self.bar is not None and self.is_main:
            self.bar.n = step
            self.bar.refresh()

    def message(self, text: str | None) -> None:
        """A line of the run log (rank 0's; None: nothing to say)."""
        if self.is_main and text is not None:
            (self.bar.write if self.bar is not None else print)(text)
            sys.stdout.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.tensorboard is not None:
            self.tensorboard.close()


EVAL_PREFIX = "eval/"  # train.evals' results: eval/<task>/<metric>


def validation_line(record: dict[str, Any]) -> str:
    """A validation record as one line: the loss, and the harness's metrics task by task."""
    parts = []
    if "val_loss" in record:
        parts.append(
            f"validation loss {record['val_loss']:.4f}, perplexity {record['val_ppl']:,.2f} "
            f"({record['val_tokens']:,} tokens)"
        )
    tasks: dict[str, list[str]] = {}
    for key, value in record.items():
        if key.startswith(EVAL_PREFIX) and not key.endswith("_stderr"):
            task, _, metric = key.removeprefix(EVAL_PREFIX).rpartition("/")
            tasks.setdefault(task, []).append(f"{metric} {'nan' if value is None else f'{value:.4g}'}")
    parts += [f"{task} {', '.join(metrics)}" for task, metrics in tasks.items()]
    return f"step {record['step']}: " + " | ".join(parts)


def format_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def wandb_mode(cfg: RunConfig) -> str:
    if cfg.wandb.mode is not None:
        return cfg.wandb.mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def start_wandb(cfg: RunConfig, config: dict[str, Any] | None = None):
    """A W&B run (offline when there is no API key, so a run never fails for lack of network), with
    ``config`` (default: the config as written) as its config.

    W&B never stops a run: when online start-up fails (server unreachable, bad key, timeout) one warning
    line says so and the run logs offline, into files that `wandb sync` uploads later. A server that does
    not answer a TCP connection within seconds (WANDB_BASE_URL, or as W&B's settings say) is known
    offline at once; otherwise start-up waits at most WANDB_INIT_TIMEOUT seconds (W&B's default, 90), and less than
    half of parallel.timeout_minutes, so the other ranks, waiting in a collective meanwhile, do not time out.
    """
    mode = wandb_mode(cfg)
    if mode == "disabled":
        return None
    import wandb

    # W&B's own messages (credentials found, retries, errors) stay in its debug logs; the run log is ours
    quiet = wandb.Settings(
        silent=True, quiet=True, console="off", show_info=False, show_warnings=False, show_errors=False
    )
    configured = wandb.setup(quiet).settings.base_url  # from W&B's settings files, or its default
    run_dir = Path(cfg.run_dir)
    timeout = min(float(os.environ.get("WANDB_INIT_TIMEOUT", 90)), cfg.parallel.timeout_minutes * 60 / 2)
    init = dict(
        project=cfg.wandb.project,
        entity=cfg.wandb.entity,
        name=cfg.wandb.name or run_dir.name,
        tags=cfg.wandb.tags,
        config=config or cfg.model_dump(mode="json"),
        dir=str(run_dir),
        resume="allow",
        id=_run_id(run_dir),
    )
    if mode != "online":
        return _offline_run(wandb, init, mode, quiet)
    down = unreachable(os.environ.get("WANDB_BASE_URL") or configured)
    if down is not None:
        _warn_offline(f"cannot reach the W&B server, {down}", run_dir)
        return _offline_run(wandb, init, "offline", quiet)
    try:
        return wandb.init(**init, mode="online", settings=quiet.model_copy(update={"init_timeout": timeout}))
    except Exception as err:  # noqa: BLE001 - whatever W&B raises, the run goes on offline
        _warn_offline(f"W&B online start-up failed ({_reason(err)})", run_dir)
        wandb.teardown()  # the failed run still holds its id in W&B's service process
        return _offline_run(wandb, init, "offline", quiet)


def _offline_run(wandb, init: dict[str, Any], mode: str, settings):
    """W&B's run in ``mode`` (offline, or W&B's own dryrun), or None with a warning should W&B fail to start even
    so (its service process, slow to start on a busy machine): the run goes on, its numbers in metrics.jsonl."""
    try:
        return wandb.init(**init, mode=mode, settings=settings)
    except Exception as err:  # noqa: BLE001 - whatever W&B raises, the run goes on without it
        to_stderr(
            f"warning: W&B did not start ({_reason(err)}); the run goes on without it, every number in "
            f"{Path(init['dir']) / 'metrics.jsonl'}"
        )
        return None


def _reason(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _warn_offline(reason: str, run_dir: Path) -> None:
    to_stderr(
        f"warning: {reason}; logging offline instead, upload later with `wandb sync {run_dir / 'wandb'}/offline-run-*`",
    )


def _run_id(run_dir: Path) -> str:
    """A stable id per run directory, so a resumed run continues the same W&B run."""
    path = run_dir / "wandb_run_id"
    if not path.is_file():
        import uuid

        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()
