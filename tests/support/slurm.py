"""The local Slurm cluster (slurm/local-cluster.sh) in tests: whether it is up, and jobs on it."""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

JOB_TIMEOUT = 600  # s; the first job on a bare machine also JIT-builds DeepSpeed's shm op (~70 s)
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


def cluster_problem() -> str | None:
    """None when the local cluster answers with two usable nodes, else what is wrong."""
    if shutil.which("sbatch") is None:
        return "sbatch not found: start the cluster with `bash slurm/local-cluster.sh start` (root)"
    try:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: is slurmctld running? (`bash slurm/local-cluster.sh start`)"
    states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
    usable = [n for n, s in states.items() if s.rstrip("*") in ("idle", "mix", "alloc", "comp")]
    if out.returncode != 0 or len(usable) < 2:
        return (
            f"the local Slurm cluster is not up (sinfo: {out.stdout.strip() or out.stderr.strip()}); "
            "run `bash slurm/local-cluster.sh start` as root"
        )
    return None


class Job:
    def __init__(self, job_id: int, log: Path) -> None:
        self.id, self.log = job_id, log

    def info(self) -> dict[str, str]:
        out = subprocess.run(
            ["scontrol", "show", "job", "-o", str(self.id)], capture_output=True, text=True, timeout=30
        ).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.is_file() else "(no log yet)"

    def report(self, why: str) -> str:
        info = subprocess.run(
            ["scontrol", "show", "job", str(self.id)], capture_output=True, text=True, timeout=30
        ).stdout
        return f"{why}\n--- scontrol show job {self.id}\n{info}\n--- {self.log}\n{self.text()}"

    def wait(self, done, timeout: float, what: str) -> dict[str, str]:
        """Poll until done(info) is true; fail with the log when the time is up."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.info()
            if done(info):
                return info
            time.sleep(0.5)
        pytest.fail(self.report(f"job {self.id}: {what} did not happen within {timeout:.0f} s"))

    def wait_finished(self, timeout: float = JOB_TIMEOUT) -> dict[str, str]:
        return self.wait(lambda i: i.get("JobState") in ENDED, timeout, "the end")

    def wait_requeued(self, timeout: float = 180) -> dict[str, str]:
        """Until the job has requeued itself and is PENDING again; fail if it ends instead. Its restart count
        rises while it still passes through REQUEUED and COMPLETING, states in which it cannot be updated."""
        info = self.wait(
            lambda i: (i.get("Restarts") == "1" and i.get("JobState") == "PENDING") or i.get("JobState") in ENDED,
            timeout,
            "the requeue",
        )
        if info.get("JobState") != "PENDING":
            pytest.fail(self.report(f"the signalled job ended ({info.get('JobState')}) instead of requeueing itself"))
        return info
