"""What a run reports: metrics.jsonl, a progress bar (or log lines when not a TTY), W&B. Rank 0 only."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from megatransformer.config import RunConfig

H100_BF16_TFLOPS = 989.0


def peak_tflops(cfg: RunConfig, device: str) -> float:
    """Per-device peak for the MFU estimate: train.peak_tflops, else a known GPU, else a measured matmul peak."""
    if cfg.train.peak_tflops:
        return cfg.train.peak_tflops
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    if device.startswith("cuda") and "H100" in torch.cuda.get_device_name():
        return H100_BF16_TFLOPS if dtype == torch.bfloat16 else H100_BF16_TFLOPS / 2
    a = torch.randn(1024, 1024, device=device, dtype=dtype)
    a @ a
    started, n = time.perf_counter(), 0
    while time.perf_counter() - started < 0.2:
        a @ a
        n += 1
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return 2 * 1024**3 * n / (time.perf_counter() - started) / 1e12


def truncate_metrics(path: Path, after_step: int) -> None:
    """On resume, drop lines of steps after the checkpoint: they are re-run and logged again."""
    if not path.is_file():
        return
    kept = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line).get("step", 0) <= after_step]
    path.write_text("".join(line + "\n" for line in kept))


class Reporter:
    def __init__(self, cfg: RunConfig, is_main: bool, start_step: int) -> None:
        self.cfg, self.is_main = cfg, is_main
        self.path = Path(cfg.run_dir) / "metrics.jsonl"
        self.bar = None
        self.wandb = None
        self._last_line = time.perf_counter()
        if not is_main:
            return
        truncate_metrics(self.path, start_step)
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.max_steps, initial=start_step, unit="step", dynamic_ncols=True)
        self.wandb = start_wandb(cfg)

    def log(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def progress(self, step: int, loss: float, tokens_per_s: float, seconds_per_step: float) -> None:
        if not self.is_main:
            return
        eta = (self.cfg.train.max_steps - step) * seconds_per_step
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tokens_per_s:,.0f} tok/s", refresh=True)
        elif step % self.cfg.train.log_every == 0 or step == self.cfg.train.max_steps:
            print(f"step {step}/{self.cfg.train.max_steps} loss {loss:.4f} {tokens_per_s:,.0f} tok/s "
                  f"eta {eta / 60:.1f} min", flush=True)

    def message(self, text: str) -> None:
        if self.is_main:
            (self.bar.write if self.bar is not None else print)(text)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


def wandb_mode(cfg: RunConfig) -> str:
    if cfg.wandb.mode is not None:
        return cfg.wandb.mode
    return "online" if os.environ.get("WANDB_API_KEY") else "offline"


def start_wandb(cfg: RunConfig):
    """A W&B run (offline when there is no API key, so a run never fails for lack of network).

    W&B never stops a run: when online start-up fails (server unreachable, bad key, timeout) one warning
    line says so and the run logs offline, into files that `wandb sync` uploads later. Start-up waits at
    most WANDB_INIT_TIMEOUT seconds (W&B's default, 90), and less than half of parallel.timeout_minutes,
    so the other ranks, waiting in a collective meanwhile, do not time out.
    """
    mode = wandb_mode(cfg)
    if mode == "disabled":
        return None
    import wandb

    # W&B's own messages (credentials found, retries, errors) stay in its debug logs; the run log is ours
    quiet = wandb.Settings(silent=True, quiet=True, console="off", show_info=False, show_warnings=False,
                           show_errors=False)
    wandb.setup(quiet)
    run_dir = Path(cfg.run_dir)
    timeout = min(float(os.environ.get("WANDB_INIT_TIMEOUT", 90)), cfg.parallel.timeout_minutes * 60 / 2)
    init = dict(project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name or run_dir.name,
                tags=cfg.wandb.tags, config=cfg.model_dump(mode="json"), dir=str(run_dir), resume="allow",
                id=_run_id(run_dir))
    if mode != "online":
        return wandb.init(**init, mode=mode, settings=quiet)
    try:
        return wandb.init(**init, mode="online", settings=quiet.model_copy(update={"init_timeout": timeout}))
    except Exception as err:  # noqa: BLE001 - whatever W&B raises, the run goes on offline
        reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"warning: W&B online start-up failed ({reason}); logging offline instead, upload later with "
              f"`wandb sync {run_dir / 'wandb'}/offline-run-*`", file=sys.stderr, flush=True)
        wandb.teardown()  # the failed run still holds its id in W&B's service process
        return wandb.init(**init, mode="offline", settings=quiet)


def _run_id(run_dir: Path) -> str:
    """A stable id per run directory, so a resumed run continues the same W&B run."""
    path = run_dir / "wandb_run_id"
    if not path.is_file():
        import uuid

        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()
