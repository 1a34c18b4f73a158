"""``train.compile=true`` on 2 gloo ranks: at ZeRO-3 each block's forward is compiled with DeepSpeed's hooks
outside the graph (``compiled.gather_whole_blocks``), with tensor parallelism each block whole, and both together on
4 ranks; none breaks a graph, by dynamo's own log (``TORCH_LOGS=graph_breaks``) and by the run log, and ZeRO-3's
losses are the eager run's, with activation checkpointing and with tensor parallelism too. A block that reads a
value to the host breaks its graph: the run log says so after the first step, with the reason.
"""

from __future__ import annotations

import os
import subprocess

import pytest
from support.runs import losses, tiny_run, torchrun, train

DYNAMO_LOG = {"TORCH_LOGS": "graph_breaks", "OMP_NUM_THREADS": "1"}
CLEAN = "torch.compile, step 1: 1 frame(s) compiled, no graph break"  # (one graph for both blocks)

# `megatransformer train` with every block reading its input's norm to the host: a graph break in each block
READING_BLOCKS = """
import sys

from megatransformer.cli import main
from megatransformer.model import layers

forward = layers.Block.forward


def reading_forward(self, x, *args, **kwargs):
    x.float().norm().item()
    return forward(self, x, *args, **kwargs)


layers.Block.forward = reading_forward
sys.exit(main())
"""


def compiler_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("torch.compile, step")]


@pytest.mark.parametrize("checkpointing", [False, True])
def test_zero3_compiles_each_block_without_a_graph_break_and_trains_as_eager(tiny_data, tmp_path, checkpointing):
    """With activation checkpointing ZeRO-3 gathers each block again for its recomputation in the backward."""
    runs = {}
    for compiled in (False, True):
        run = tmp_path / f"compile-{compiled}"
        overrides = [
            "parallel.zero_stage=3",
            f"model.activation_checkpointing={str(checkpointing).lower()}",
            f"train.compile={str(compiled).lower()}",
        ]
        result = train(tiny_run(tiny_data, run, steps=4) + overrides, nproc=2, env=DYNAMO_LOG)
        runs[compiled] = losses(run)
        assert "Graph break" not in result.stderr  # (dynamo's log, each rank's)
        assert compiler_lines(result.stdout) == ([CLEAN] if compiled else [])
    assert runs[True] == pytest.approx(runs[False], rel=1e-3)


def test_tensor_parallel_compiles_each_block_without_a_graph_break(tiny_data, tmp_path):
    layout = ["parallel.zero_stage=1", "parallel.tensor_parallel=2", "train.compile=true"]
    result = train(tiny_run(tiny_data, tmp_path / "tp", steps=3) + layout, nproc=2, env=DYNAMO_LOG)
    assert "Graph break" not in result.stderr
    assert compiler_lines(result.stdout) == [CLEAN]


def test_zero3_with_tensor_parallelism_compiles_without_a_graph_break_and_trains_as_one_rank(tiny_data, tmp_path):
    """dp2 x tp2 on 4 ranks: AutoTP's slices partitioned by ZeRO-3, each block compiled inside ZeRO-3's hooks; the
    losses those of one eager rank on the same global batches."""
    batch = {"train.global_batch_size": 16, "train.grad_accum": None}
    train(tiny_run(tiny_data, tmp_path / "one", steps=3, changes=batch))
    layout = ["parallel.zero_stage=3", "parallel.tensor_parallel=2", "train.compile=true"]
    result = train(tiny_run(tiny_data, tmp_path / "four", steps=3, changes=batch) + layout, nproc=4, env=DYNAMO_LOG)
    assert "layout: dp2 x tp2 on 4 ranks" in result.stdout
    assert "Graph break" not in result.stderr
    assert compiler_lines(result.stdout) == [CLEAN]
    assert losses(tmp_path / "four") == pytest.approx(losses(tmp_path / "one"), rel=1e-5)


def test_a_graph_break_in_a_block_is_reported_after_the_first_step(tiny_data, tmp_path):
    script = tmp_path / "reading_blocks.py"
    script.write_text(READING_BLOCKS)
    overrides = tiny_run(tiny_data, tmp_path / "run", steps=3) + ["parallel.zero_stage=3", "train.compile=true"]
    command = [*torchrun(2), str(script), "train", "--config", os.devnull, *overrides]
    result = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines = compiler_lines(result.stdout)
    assert lines[0].startswith("torch.compile, step 1:") and lines[0].endswith("graph break(s)"), lines
    assert any(line.startswith("torch.compile, step 1: graph break") and "Tensor.item()" in line for line in lines)
