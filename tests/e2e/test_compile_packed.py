"""Packed batches compile once: over 50 steps of documents of changing lengths, each Transformer block compiled
as the trainer compiles it (``compiled.compile_blocks``), the compiler works in the first two steps only: no
recompile and no graph break after them, read from dynamo's own records (``compiled.CompileWatch``).

The chunked core trains; the flex core runs forward only (FlexAttention has no backward on CPU); flash-attn's
varlen path runs over the custom op of ``support.flash_ops`` (opaque to the compiler, as flash-attn's ops are),
with the metadata the trainer builds for it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.flash_ops import FLASH_OPS
from support.models import tiny_config
from support.runs import losses, tiny_run, train

from megatransformer.model import attention, build_model
from megatransformer.model.masks import batch_masks
from megatransformer.training.engine.compiled import WARMUP_STEPS, CompileWatch, compile_blocks

ROWS, T, STEPS = 2, 32, 50


def packed_batch(rng: np.random.Generator) -> dict[str, torch.Tensor]:
    """Rows of 1-4 documents of random lengths (2-4 in the first: a batch of one document per row is a plain
    causal mask, its own graph), the last row ending in 0-4 positions of padding."""
    segments = np.zeros((ROWS, T), dtype=np.int64)
    for row in range(ROWS):
        cuts = np.sort(rng.choice(np.arange(1, T), size=rng.integers(row == 0, 4), replace=False))
        segments[row] = np.searchsorted(cuts, np.arange(T), side="right") + 1
    segments[-1, T - rng.integers(0, 5) :] = 0
    return {"input_ids": torch.randint(0, 97, (ROWS, T)), "segment_ids": torch.from_numpy(segments)}


def compiler_work(backend: str, train: bool, checkpointing: bool | str = False) -> tuple[list[str], list[str]]:
    """The watch's lines on the first step, and all its lines after warm-up."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    torch.manual_seed(0)
    cfg = tiny_config(position="rope", attention_backend=backend, activation_checkpointing=checkpointing)
    model = build_model(cfg).train(train)
    assert compile_blocks(model) == 2
    rng = np.random.default_rng(0)
    watch, reports = CompileWatch(), []
    for _ in range(STEPS):
        batch = packed_batch(rng)
        masks = batch_masks("decoder", batch, varlen=backend == "flash")
        with torch.set_grad_enabled(train):
            loss = model(input_ids=batch["input_ids"], masks=masks, labels=batch["input_ids"])
            if train:
                loss.backward()
        reports.append(watch.after_step())
    assert CompileWatch.counts()[0] > 0  # (the blocks were compiled)
    assert reports[0][0].startswith("torch.compile, step 1: ")
    return reports[0], [line for lines in reports[WARMUP_STEPS:] for line in lines]


@pytest.mark.parametrize("backend, train", [("chunked", True), ("flex", False)])
def test_packed_batches_compile_once(backend, train):
    first, later = compiler_work(backend, train)
    assert first[0].endswith(", no graph break") and later == []
    assert CompileWatch.graph_break_reasons() == []


@pytest.mark.parametrize("checkpointing", [True, "selective"])
def test_checkpointed_compiled_blocks_compile_once(checkpointing):
    first, later = compiler_work("chunked", True, checkpointing)
    assert first[0].endswith(", no graph break") and later == []
    assert CompileWatch.graph_break_reasons() == []


def test_packed_varlen_batches_compile_once(monkeypatch):
    """Known, not yet fixed: in the first step inductor fails on a scalar read (``aten._local_scalar_dense``) in
    the graphs around the varlen op and dynamo splits them (counted as "unimplemented", so the watch before this
    one missed them); the first step's lines say so. After warm-up, nothing more compiles."""
    monkeypatch.setattr(attention, "flash_attn_module", lambda: FLASH_OPS)
    first, later = compiler_work("flash", True)
    assert later == []
    assert "no graph break" not in first[0]
    assert any("graph break" in line and "Backend compiler exception" in line for line in first)


class Doubling(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_recompile_is_reported_with_its_reason():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layer = Doubling()
    layer.compile(backend="eager", dynamic=False)
    watch = CompileWatch()
    layer(torch.ones(2, 4))
    assert watch.after_step() == ["torch.compile, step 1: 1 frame(s) compiled, no graph break"]
    for _ in range(2):
        layer(torch.ones(2, 4))
        assert watch.after_step() == []
    layer(torch.ones(3, 4))  # a new shape, with dynamic=False: compiled again
    (line,) = watch.after_step()
    assert line.startswith("torch.compile, step 4: recompiled forward (test_compile_packed.py:")
    assert "size mismatch at index 0. expected 2, actual 3" in line


class Reading(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        return y * y.sum().item()  # a host read: a graph break


def test_a_graph_break_is_reported_from_the_first_step():
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    layer = Reading()
    layer.compile(backend="eager")
    watch = CompileWatch()
    layer(torch.ones(2, 4))
    first, reason = watch.after_step()
    assert first.startswith("torch.compile, step 1:") and first.endswith(", 1 graph break(s)")
    assert reason.startswith("torch.compile, step 1: graph break: Unsupported Tensor.item() call")
    layer(torch.ones(2, 4))
    assert watch.after_step() == []  # (the same break, resumed by the graphs already compiled: no new work)


def test_a_compiled_cpu_run_trains_as_the_eager_one_and_says_so(tiny_data, tmp_path):
    """``train.compile=true`` on CPU: each block compiled behind DeepSpeed's engine, the run log says so, that the
    first step compiled one graph for both blocks, and reports no graph break nor recompile; the losses are the
    eager run's (the compiler may reorder float sums)."""
    runs = {}
    for compiled in (False, True):
        run = tmp_path / f"compile-{compiled}"
        result = train(tiny_run(tiny_data, run, steps=6) + [f"train.compile={str(compiled).lower()}"])
        runs[compiled] = losses(run)
        expected = "torch.compile: each Transformer block (train.compile)" if compiled else "torch.compile: off"
        assert expected in result.stdout
        compiler_lines = [line for line in result.stdout.splitlines() if line.startswith("torch.compile, step")]
        assert compiler_lines == (["torch.compile, step 1: 1 frame(s) compiled, no graph break"] if compiled else [])
    assert runs[True] == pytest.approx(runs[False], rel=1e-3)
