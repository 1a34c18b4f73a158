"""Batches from the data loaders, compared tensor by tensor."""

from __future__ import annotations

import torch

INSTRUCTION_VALID_EVERY = 5  # the tiny_instructions fixture's validation split: every 5th example


def take(loader, n: int) -> list[dict[str, torch.Tensor]]:
    """The loader's first ``n`` batches (fewer if it ends before)."""
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == n:
            break
    return batches


def assert_same_batches(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key
