"""ZeRO-3 builds the model partitioned (training/engine/construction.py): the weights of the one-rank build of the
seed, and of init_from, with no rank holding more than its partition and one layer."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from support import REPO
from support.runs import ONE_THREAD, torchrun


def records_of(script: str, nproc: int, out: Path) -> list[dict]:
    """Each rank's record of ``support.SCRIPT`` run on ``nproc`` gloo ranks, which writes them into ``out``."""
    env = {**os.environ, **ONE_THREAD, "DS_ACCELERATOR": "cpu"}
    command = [*torchrun(nproc), "-m", f"support.{script}", str(out)]
    done = subprocess.run(command, cwd=REPO / "tests", env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(nproc)]


def test_zero3_builds_the_one_rank_weights_holding_a_partition_and_a_layer(tmp_path):
    ranks = records_of("sharded_build", 2, tmp_path)
    whole_bf16 = 2 * ranks[0]["whole"]
    for rank in ranks:
        for precision in ("fp32", "bf16"):
            assert rank[f"differing_{precision}"] == [] and rank[f"differing_loaded_{precision}"] == [], rank
            # (each rank draws, and reads from init_from's weights, its partitions alone: none gathers or broadcasts)
            assert rank[f"gathers_in_build_{precision}"] == rank[f"gathers_in_load_{precision}"] == 0, rank
            assert rank[f"broadcasts_in_build_{precision}"] == rank[f"broadcasts_in_load_{precision}"] == 0, rank
        assert rank["partition"] <= whole_bf16 / 2 + 1024  # (ZeRO-3 pads each partition to a few elements)
        # the parameters never held more than this rank's partition and one layer whole (the whole model: 4.1x)
        assert rank["held"] <= rank["partition"] + rank["layer"], rank
        # nor did torch's allocator hold 0.6 of what the build of the whole fp32 model holds (0.4-0.5 of it)
        assert rank["peak"] < 0.6 * rank["whole_build"], rank


def test_tensor_parallel_builds_each_ranks_slices_of_the_one_rank_weights(tmp_path):
    """tensor_parallel=2 on 2 ranks, ZeRO-0 and ZeRO-3: AutoTP slices the linear layers on the meta device and each
    rank makes only its slices (support/tp_build.py)."""
    ranks = records_of("tp_build", 2, tmp_path)
    for rank in ranks:
        for case in ("0_fp32", "0_bf16", "3_fp32", "3_bf16"):
            assert rank[f"differing_{case}"] == [] and rank[f"differing_loaded_{case}"] == [], (case, rank)
            # init_from: the split matrices read slice by slice, none whole
            assert rank[f"split_read_whole_{case}"] == [] and rank[f"split_not_sliced_{case}"] == [], (case, rank)
        assert rank["shard"] < 0.6 * rank["whole"]  # (the matrices halved; embeddings and norms whole)
        # torch's allocator never held more than the rank's parameters and one layer whole (+ DeepSpeed's start)
        assert rank["peak"] <= rank["shard"] + rank["layer"] + (1 << 20), rank
        assert rank["peak"] < 0.7 * rank["whole_build"], rank


def test_zero3_with_tensor_parallelism_partitions_each_slice_as_it_is_made(tmp_path):
    """tensor_parallel=2 over 4 ranks at ZeRO-3, fp32 and bf16: every parameter, slices and replicated ones, is
    partitioned over the 2 data-parallel ranks as it is made (support/tp_sharded_build.py)."""
    ranks = records_of("tp_sharded_build", 4, tmp_path)
    for rank in ranks:
        for precision in ("fp32", "bf16"):
            assert rank[f"whole_after_build_{precision}"] == [], rank  # (the replicated ones partitioned too)
            assert rank[f"broadcasts_{precision}"] == 0, rank  # (each partition written by its rank alone)
            assert rank[f"differing_{precision}"] == [] and rank[f"differing_loaded_{precision}"] == [], rank
            assert rank[f"split_read_whole_{precision}"] == [] and rank[f"split_not_sliced_{precision}"] == [], rank
            # a quarter of the model and ZeRO-3's padding (the split matrices halved, then everything halved)
            partition = rank[f"partition_{precision}"]
            assert partition < 0.3 * rank[f"whole_{precision}"], rank
            # the parameters never held more than the rank's partition and one layer whole (its slices: 2x)
            assert rank[f"held_{precision}"] <= partition + rank[f"layer_{precision}"], rank
            # nor did torch's allocator, counting a layer in fp32 (a parameter is drawn in fp32, then cut and cast)
            assert rank[f"peak_{precision}"] <= partition + rank["layer_fp32"], rank
