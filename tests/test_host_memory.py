"""train.host_memory: with ``keep`` a training process stops paying page faults for the tensors every step
allocates anew; ``release`` leaves the C library's defaults. Each policy runs in a fresh interpreter (it
changes the process's allocator for good)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

from megatransformer.training.host_memory import apply_host_memory_policy

# A step's pattern: tensors of many sizes from 256 KiB to 64 MiB written, then freed, again and again.
# Prints the line of the policy and the minor page faults of five repeats after four.
PROBE = """
import json, resource, sys
import torch
from megatransformer.training.host_memory import apply_host_memory_policy
line = apply_host_memory_policy(sys.argv[1])
sizes = [2**k for k in range(16, 25)]  # float32 elements: 256 KiB ... 64 MiB
def step():
    tensors = [torch.ones(n) for n in sizes]
    del tensors
for _ in range(4):  # the heap grows to the step's peak, in a few steps around what stays allocated
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(json.dumps({"line": line, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""

glibc = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the keep policy acts on glibc's malloc only")


def faults(policy: str) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, policy], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@glibc
def test_keep_stops_page_faults_of_repeated_steps() -> None:
    kept, released = faults("keep"), faults("release")
    touched_pages = 5 * sum(4 * 2**k for k in range(16, 25)) // 4096  # pages the five repeats write
    assert released["faults"] > touched_pages // 4, released  # glibc hands large blocks back and faults again
    assert kept["faults"] < touched_pages // 100, kept  # the heap keeps them
    assert kept["line"].startswith("host memory: keep (glibc malloc"), kept
    assert released["line"] == "host memory: release (the C library's defaults)"


def test_other_c_libraries_are_told_not_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert apply_host_memory_policy("keep") == (
        "host memory: keep has no effect with this C library (glibc only); its defaults apply")


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="choose from"):
        apply_host_memory_policy("cache")
