"""What the GPU machine's image lacks reaches it through ``bench/gpu_wheels.sh``: the data pipeline imports
zstandard only for .zst shards and inputs (not in the H200 image), and the wheel list names it; core mode installs
one tar without flash-attn 4, fa4 mode joins its parts and imports it; a tar that fails its checksum installs
nothing."""

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
    install = next(line for line in script.splitlines() if line.startswith("INSTALL_CORE=("))
    assert "zstandard==0.25.0" in install


FAKE_PYTHON = """#!/bin/sh
echo "$*" >> "$CALLS"
"""


def install(tmp_path, mode: str, parts: int, corrupt: bool = False) -> tuple[subprocess.CompletedProcess, str]:
    """``gpu_wheels.sh install`` of a tar of one file (whole, or split in ``parts``), with a python3 that records
    its calls."""
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "x.whl").write_bytes(b"wheel" * 1000)
    subprocess.run(["tar", "-C", tmp_path, "-cf", tmp_path / "wheels.tar", "wheels"], check=True)
    sums = subprocess.run(["sha256sum", "wheels.tar"], cwd=tmp_path, capture_output=True, text=True, check=True)
    (tmp_path / "SHA256SUMS").write_text(sums.stdout)
    if corrupt:
        (tmp_path / "wheels.tar").write_bytes(b"no tar")
    tar_parts = ["wheels.tar"]
    if parts > 1:
        subprocess.run(["split", "-n", str(parts), "wheels.tar", "wheels.tar.part-"], cwd=tmp_path, check=True)
        tar_parts = sorted(path.name for path in tmp_path.glob("wheels.tar.part-*"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls")}
    command = [str(REPO / "bench" / "gpu_wheels.sh"), "install", mode, *tar_parts, "SHA256SUMS"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True)
    calls = (tmp_path / "calls").read_text() if (tmp_path / "calls").exists() else ""
    return done, calls


def test_core_mode_installs_one_tar_without_flash_attn_4(tmp_path):
    done, calls = install(tmp_path, "core", parts=1)
    assert done.returncode == 0, done.stderr
    pip, check = calls.splitlines()
    assert pip.startswith("-m pip install -q --no-index --no-compile") and "deepspeed==0.19.8" in pip
    assert "zstandard==0.25.0" in pip and "flash-attn" not in pip
    assert (
        check.startswith("-c import torch, deepspeed, webdataset, pydantic, zstandard;") and "flash_attn" not in check
    )


def test_fa4_mode_joins_its_parts_and_imports_flash_attn_4(tmp_path):
    done, calls = install(tmp_path, "fa4", parts=2)
    assert done.returncode == 0, done.stderr
    pip, check = calls.splitlines()
    assert "flash-attn-4==4.0.0b36" in pip and "deepspeed==0.19.8" in pip
    assert "flash_attn.cute.interface" in check


def test_a_tar_that_fails_its_checksum_installs_nothing(tmp_path):
    done, calls = install(tmp_path, "core", parts=1, corrupt=True)
    assert done.returncode != 0 and "FAILED" in done.stdout + done.stderr and calls == ""
