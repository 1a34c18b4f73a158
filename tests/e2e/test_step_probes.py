"""One optimizer step waits for the device a fixed, small number of times, and its collectives run on the
run's device: measured with megatransformer.training.observability.probes on real DeepSpeed engines (one process, CPU).

On this CPU the run's device is the host, so the collective check can only confirm the wiring;
``bench/gpu_check.py`` runs the same probe on CUDA, where a host tensor in a collective is caught.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from support import REPO

PROBE = REPO / "bench" / "step_probe.py"
SMALL = {"layers": 1, "accum": 1}
LARGE = {"layers": 3, "accum": 3}
CASES = [
    {**SMALL, "zero": 0},
    {**LARGE, "zero": 0},
    {**SMALL, "zero": 2, "precision": "bf16"},
    {**LARGE, "zero": 2, "precision": "bf16"},
    {**LARGE, "zero": 2, "precision": "bf16", "objective": "prefix_lm"},
    {**SMALL, "zero": 3, "precision": "bf16"},
    {**LARGE, "zero": 3, "precision": "bf16"},
]


@pytest.fixture(scope="module")
def probes() -> list[dict]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(
        [sys.executable, str(PROBE), json.dumps(CASES)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def test_host_syncs_per_step_do_not_grow_with_layers_or_micro_batches(probes):
    by_case = {(p["zero"], p["layers"], p["accum"], p.get("objective", "")): p for p in probes}
    assert len(by_case) == len(CASES)
    # ZeRO-0: the one read of the step's statistics (loss, finite flag, stop, tokens), nothing else
    assert by_case[0, 1, 1, ""]["host_syncs"] == by_case[0, 3, 3, ""]["host_syncs"] == 1
    for zero in (2, 3):  # ZeRO adds its own overflow / norm checks: a constant few
        small, large = by_case[zero, 1, 1, ""], by_case[zero, 3, 3, ""]
        assert small["host_syncs"] == large["host_syncs"] <= 5, (small, large)
    for probe in probes:  # a step left to read (one that logs nothing): ZeRO's own checks only, none of ours
        assert probe["left_to_read_host_syncs"] == probe["host_syncs"] - 1, probe
    packed_prefix = by_case[2, 3, 3, "prefix_lm"]  # per-document prefixes, packed: metadata from the host
    assert packed_prefix["host_syncs"] == by_case[2, 3, 3, ""]["host_syncs"], packed_prefix


def test_collectives_run_on_the_runs_device(probes):
    for probe in probes:
        assert probe["collectives"] >= 2 and probe["collective_devices"] == ["cpu"], probe


def test_gpu_check_refuses_a_machine_without_cuda_in_one_line():
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "gpu_check.py")], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and done.stderr.strip().count("\n") == 0, done.stderr
    assert "no CUDA device" in done.stderr


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="page-locked memory needs CUDA (no pinned allocator on a CPU-only machine); this CPU runs pin_memory=False",
)
def test_loader_batches_are_page_locked_for_a_cuda_run(tiny_data):
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.config import RunConfig
    from megatransformer.training.data import build_run_loader as build_loader

    cfg = RunConfig.model_validate(
        {
            "model": {"vocab_size": 512},
            "data": {
                "train": str(tiny_data.shards),
                "tokenizer": str(tiny_data.tokenizer),
                "seq_len": 64,
                "streams": 4,
            },
        }
    )
    loader = build_loader(cfg, "train", 2, 0, 1, load_tokenizer(tiny_data.tokenizer), pin_memory=True)
    batch = next(iter(loader))
    assert all(t.is_pinned() for t in batch.values())
