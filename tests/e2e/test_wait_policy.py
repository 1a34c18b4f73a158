"""The CLI sets OpenMP's wait policy before torch loads libgomp, on a busy machine, unless the user chose one
(training/threads.set_wait_policy)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# A process that notes OMP_WAIT_POLICY as torch is first imported (an import hook: no sitecustomize), with the
# machine made busy (14 tasks of other work on 2 cores), then runs the CLI's `generate` (which fails after
# loading torch: no such checkpoint).
WATCH = """
import json, os, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and not seen:
            seen.append(os.environ.get("OMP_WAIT_POLICY"))
sys.meta_path.insert(0, Watch())
import megatransformer.training.threads as threads
threads.other_load, threads.usable_cores = (lambda: 14.0), (lambda: 2.0)
from megatransformer.cli import main
code = main(["generate", "--checkpoint", "no/such/checkpoint", "--prompt", "x"])
print(json.dumps({"seen": seen, "code": code}))
"""


@pytest.mark.parametrize(
    "chosen,seen",
    [({}, "PASSIVE"), ({"OMP_WAIT_POLICY": "ACTIVE"}, "ACTIVE"), ({"GOMP_SPINCOUNT": "1000"}, None)],
)
def test_the_cli_sets_the_wait_policy_before_torch_is_imported(chosen, seen):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | chosen
    done = subprocess.run([sys.executable, "-c", WATCH], capture_output=True, text=True, env=env, timeout=300)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"seen": [seen], "code": 2}, done.stderr
