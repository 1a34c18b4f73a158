"""What the GPU machine's image lacks reaches it through ``bench/gpu_wheels.sh``: the data pipeline imports
zstandard only for .zst shards and inputs (not in the H200 image), and the wheel list names it."""

from __future__ import annotations

import subprocess
import sys

from support import REPO

WITHOUT_ZSTANDARD = """
import sys
sys.modules["zstandard"] = None  # (as on the H200 image: its import fails)
import numpy as np
from data_pipeline import documents, parts, shard
block = shard.Block(np.arange(5, dtype=np.uint16), np.array([0, 2, 5]))
back = shard.Block.from_sample(block.sample("k"))
assert back.ids.tolist() == [0, 1, 2, 3, 4] and back.offsets.tolist() == [0, 2, 5]
try:
    block.sample("k", compression="zstd")
except ImportError:
    print("zstd needs zstandard")
"""


def test_plain_shards_are_written_and_read_without_zstandard():
    done = subprocess.run([sys.executable, "-c", WITHOUT_ZSTANDARD], capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "zstd needs zstandard"  # (and only there)


def test_the_wheel_list_brings_zstandard_and_installs_it():
    script = (REPO / "bench" / "gpu_wheels.sh").read_text()
    assert "\n  zstandard==0.25.0\n" in script
    install = next(line for line in script.splitlines() if line.startswith("INSTALL=("))
    assert "zstandard==0.25.0" in install
