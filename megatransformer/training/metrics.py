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

# Dense (no sparsity) bf16 = fp16 tensor-core peaks per GPU, TFLOP/s, from NVIDIA's datasheets. The first
# name contained in torch.cuda.get_device_name() wins, so the more specific names come first. fp32 runs are
# measured against TF32, half of these.
GPU_PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.0), ("H100 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),  # H100 SXM
    ("H200 NVL", 835.0), ("H200", 989.0), ("B200", 2250.0), ("A100", 312.0),  # A100 40/80 GB, SXM and PCIe
)


def gpu_peak_tflops(device_name: str, dtype: torch.dtype) -> float | None:
    """A known GPU's dense peak for ``dtype`` (bf16/fp16; fp32 as TF32), or None for a GPU not in the table."""
    for name, peak in GPU_PEAK_TFLOPS:
        if name in device_name:
            return peak if dtype in (torch.bfloat16, torch.float16) else peak / 2
    return None


def peak_tflops(cfg: RunConfig, device: str) -> float:
    """Per-device peak for the MFU estimate: train.peak_tflops, else a known GPU, else a measured matmul peak."""
    if cfg.train.peak_tflops:
        return cfg.train.peak_tflops
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision, torch.float32)
    if device.startswith("cuda"):
        known = gpu_peak_tflops(torch.cuda.get_device_name(device), dtype)
        if known is not None:
            return known
    dtype = torch.float32 if dtype == torch.float16 and not device.startswith("cuda") else dtype
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
    """A W&B run (offline when there is no API key, so a run never fails for lack of network)."""
    mode = wandb_mode(cfg)
    if mode == "disabled":
        return None
    import wandb

    run_dir = Path(cfg.run_dir)
    return wandb.init(
        project=cfg.wandb.project, entity=cfg.wandb.entity, name=cfg.wandb.name or run_dir.name,
        tags=cfg.wandb.tags, config=cfg.model_dump(mode="json"), dir=str(run_dir), mode=mode,
        resume="allow", id=_run_id(run_dir), settings=wandb.Settings(silent=True, console="off"),
    )


def _run_id(run_dir: Path) -> str:
    """A stable id per run directory, so a resumed run continues the same W&B run."""
    path = run_dir / "wandb_run_id"
    if not path.is_file():
        import uuid

        path.write_text(uuid.uuid4().hex[:12])
    return path.read_text().strip()
