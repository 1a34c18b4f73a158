"""bf16 training accumulates gradients over micro batches and reduces them over ranks in fp32.

The engine cases run ``bench/grad_precision.py probe`` on real DeepSpeed engines in their own processes
(DeepSpeed's process group is global state), one rank and two: the optimizer DeepSpeed selects on CPU is the
one it selects on GPUs (the same config logic), and the dtypes are read from its buffers. DeepSpeed's
defaults (bf16 for both) are the comparison: what the trainer ran before it set its data types.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from support import REPO

PROBE = REPO / "bench" / "grad_precision.py"


def probe(cases: list[dict], out: Path, nproc: int = 1) -> dict[tuple, dict]:
    """The probe's report of each case, by (zero, precision, deepspeed_default); ``out`` holds the lines."""
    launch = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    done = subprocess.run(
        [sys.executable, *launch, str(PROBE), "probe", json.dumps(cases), "--out", str(out)],
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(line) for line in out.read_text().splitlines()]
    return {(r["zero"], r["precision"], r["deepspeed_default"]): r for r in reports}


def test_one_rank_bf16_accumulates_in_fp32_and_stays_closer_to_fp32(tmp_path):
    reports = probe(
        [
            {"zero": 0, "precision": "fp32"},
            {"zero": 0, "precision": "bf16"},
            {"zero": 1, "precision": "bf16", "deepspeed_default": True},
            {"zero": 1, "precision": "bf16"},
        ],
        tmp_path / "reports.jsonl",
    )
    ours, default, zero0 = reports[1, "bf16", False], reports[1, "bf16", True], reports[0, "bf16", False]
    assert (ours["optimizer"], ours["accumulates_in"], ours["reduces_in"]) == ("BF16_Optimizer", "float32", "float32")
    assert (default["optimizer"], default["accumulates_in"]) == ("DeepSpeedZeroOptimizer", "bfloat16")
    assert (zero0["optimizer"], zero0["accumulates_in"]) == ("FP16_UnfusedOptimizer", "bfloat16")
    # 4 steps of 8 micro batches. On one CPU rank zero_stage=1 ran as DeepSpeed's ZeRO-0 bf16 optimizer before:
    # its weights end 2.3x further from the fp32 run's (as far with 1 micro batch: its optimizer, not the sum).
    # Against bf16 sums at the same stage the fp32 sum is as close (bf16 forward/backward noise dominates here).
    assert ours["drift"] < 0.6 * zero0["drift"], (ours, zero0)
    assert ours["drift"] < 1.01 * default["drift"], (ours, default)


def test_two_ranks_accumulate_and_reduce_in_fp32(tmp_path):
    reports = probe(
        [{"zero": 1, "precision": "bf16", "steps": 1}, {"zero": 2, "precision": "bf16", "steps": 1}],
        tmp_path / "reports.jsonl",
        nproc=2,
    )
    assert [(r["world"], r["optimizer"], r["accumulates_in"], r["reduces_in"]) for r in reports.values()] == [
        (2, "BF16_Optimizer", "float32", "float32"),
        (2, "DeepSpeedZeroOptimizer", "float32", "float32"),
    ]
