"""What experiment trackers get besides the metrics: the resolved config and the run's facts (for W&B), a
TensorBoard writer, and a quick check that the W&B server answers before W&B's own long start-up wait."""

from __future__ import annotations

import platform
import subprocess
import threading
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path
from typing import Any

from megatransformer.config import ConfigError, RunConfig
from megatransformer.training.runtime.layout import BatchSizes

TENSORBOARD_DIR = "tensorboard"


def resolved_config(cfg: RunConfig, sizes: BatchSizes) -> dict[str, Any]:
    """The config as the run uses it: the batch fields derived for its data-parallel size filled in."""
    train = cfg.train.model_copy(
        update={"micro_batch_size": sizes.micro, "grad_accum": sizes.accum, "global_batch_size": sizes.global_batch}
    )
    return cfg.model_copy(update={"train": train}).model_dump(mode="json")


def run_facts(
    sizes: BatchSizes, world_size: int, tensor_parallel: int, zero_stage: int, parameters: int
) -> dict[str, Any]:
    """What the config does not say: the layout that ran, the model's size, the code and library versions."""
    versions = {"python": platform.python_version()}
    for package in ("megatransformer", "torch", "deepspeed", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return {
        "world_size": world_size,
        "data_parallel": sizes.dp,
        "tensor_parallel": tensor_parallel,
        "zero_stage": zero_stage,
        "global_batch_size": sizes.global_batch,
        "parameters": parameters,
        "git_commit": git_commit(),
        "versions": versions,
    }


def git_commit() -> str | None:
    """The commit of the megatransformer source checkout this runs from, or None (an installed copy)."""
    checkout = Path(__file__).resolve().parents[2]
    if not (checkout / ".git").exists():
        return None
    try:
        out = subprocess.run(
            ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def unreachable(url: str, timeout: float = 5.0) -> str | None:
    """Why no HTTP answer comes from ``url`` within ``timeout`` seconds (name lookup included, through the
    proxy of ``HTTPS_PROXY``/``HTTP_PROXY`` where one is set, as W&B would go), or None when one does: any
    status counts, an error page too. A port that accepts connections but never answers is unreachable."""
    outcome: list[str | None] = []

    def ask() -> None:
        try:
            opener = urllib.request.build_opener()  # (reads the proxy variables now, unlike urlopen's cached one)
            opener.open(urllib.request.Request(url, method="HEAD"), timeout=timeout).close()
            outcome.append(None)
        except urllib.error.HTTPError:
            outcome.append(None)  # (it answered)
        except (OSError, ValueError) as err:
            reason = getattr(err, "reason", err)
            outcome.append(f"{url}: {getattr(reason, 'strerror', None) or reason}")

    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(timeout)
    return outcome[0] if outcome else f"{url}: no answer within {timeout:g} s"


def check_tensorboard(cfg: RunConfig) -> None:
    """tensorboard=true needs the tensorboard package (torch.utils.tensorboard writes through it)."""
    if not cfg.tensorboard:
        return
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ConfigError(
            "tensorboard=true needs the tensorboard package: pip install 'megatransformer[tensorboard]'"
            " (or set tensorboard=false)"
        ) from None


class TensorBoard:
    """Every number of a metrics record as a scalar ``KIND/NAME`` (train/loss, valid/val_loss) at its step and
    wall-clock time, in ``run_dir/tensorboard``. On resume, events after ``start_step`` are dropped: those
    steps run again."""

    def __init__(self, run_dir: str | Path, start_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(Path(run_dir) / TENSORBOARD_DIR), purge_step=start_step + 1)

    def log(self, record: dict[str, Any]) -> None:
        for name, value in record.items():
            if name not in ("step", "time", "kind") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{record['kind']}/{name}", value, record["step"], walltime=record["time"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
