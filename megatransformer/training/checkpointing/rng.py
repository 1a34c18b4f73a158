"""The random number generators of one rank (Python, NumPy, torch, the rank's CUDA device), saved in a
checkpoint and restored on resume."""

from __future__ import annotations

import ast
import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every generator's state; CUDA's is the current device's only, so it restores wherever the rank sees
    its device (another node shape, one GPU per task under Slurm), whatever else is visible."""
    np_state = np.random.get_state()
    return {
        "python": repr(random.getstate()),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore :func:`rng_state`'s generators; CUDA's into the current device (skipped without CUDA)."""
    random.setstate(_tupleize(ast.literal_eval(state["python"])))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    cuda = _own_cuda_state(state["cuda"])
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)


def _own_cuda_state(saved: torch.Tensor | list[torch.Tensor] | None) -> torch.Tensor | None:
    """The current device's state; checkpoints of earlier versions hold a list, one state per device that
    was visible: the current device's entry where the list has one, else the first."""
    if not isinstance(saved, list):
        return saved
    if not saved:
        return None
    device = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return saved[device] if device < len(saved) else saved[0]


def _tupleize(value):
    return tuple(_tupleize(v) for v in value) if isinstance(value, (list, tuple)) else value
