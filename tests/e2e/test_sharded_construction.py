"""ZeRO-3 builds the model partitioned (training/engine/construction.py): the weights of the one-rank build of the
seed, and of init_from, with no rank holding more than its partition and one layer."""

from __future__ import annotations

import json
import os
import subprocess

from support import REPO
from support.runs import ONE_THREAD, torchrun


def test_zero3_builds_the_one_rank_weights_holding_a_partition_and_a_layer(tmp_path):
    env = {**os.environ, **ONE_THREAD, "DS_ACCELERATOR": "cpu"}
    command = [*torchrun(2), "-m", "support.sharded_build", str(tmp_path)]
    done = subprocess.run(command, cwd=REPO / "tests", env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    whole_bf16 = 2 * ranks[0]["whole"]
    for rank in ranks:
        for precision in ("fp32", "bf16"):
            assert rank[f"differing_{precision}"] == [] and rank[f"differing_loaded_{precision}"] == [], rank
        assert rank["partition"] <= whole_bf16 / 2 + 1024  # (ZeRO-3 pads each partition to a few elements)
        # the parameters never held more than this rank's partition and one layer whole (the whole model: 4.1x)
        assert rank["held"] <= rank["partition"] + rank["layer"], rank
        # nor did torch's allocator hold 0.6 of what the build of the whole fp32 model holds (0.4-0.5 of it)
        assert rank["peak"] < 0.6 * rank["whole_build"], rank
