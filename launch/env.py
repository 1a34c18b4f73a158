"""Read whichever launcher environment this process runs in and turn it into torch.distributed's variables.

Three cases, tried in this order:

* torchrun (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` already set): kept as is;
* a Slurm job step started by ``srun`` (``SLURM_STEP_ID`` and ``SLURM_PROCID`` set): the rank, local rank and
  world size come from ``SLURM_PROCID`` / ``SLURM_LOCALID`` / ``SLURM_STEP_NUM_TASKS``; the master is the step's
  first node (``scontrol show hostnames``), the port is derived from the job id, so every task computes the same
  address without talking to the others (no ssh, no hostfile);
* neither: a single process (the trainer makes a world of one).

A Slurm batch script itself (no ``srun``) also has ``SLURM_PROCID``, but is not a task of a parallel step; it is
treated as a single process and says so.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
PORT_BASE, PORT_SPAN = 20000, 12000  # 20000-31999: below Linux's ephemeral range (32768+)


class LaunchError(RuntimeError):
    """The launcher environment is inconsistent; the message says which variable and how to fix it."""


@dataclass(frozen=True)
class DistEnv:
    launcher: str  # "torchrun", "slurm" or "single"
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None  # None: the trainer picks a free one (single process)
    note: str = ""  # one line worth printing (e.g. why this is a single process)

    def variables(self) -> dict[str, str]:
        """The environment torch.distributed / DeepSpeed read (nothing for a single process)."""
        if self.launcher == "single":
            return {}
        return {
            "RANK": str(self.rank),
            "LOCAL_RANK": str(self.local_rank),
            "WORLD_SIZE": str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "MASTER_ADDR": self.master_addr,
            "MASTER_PORT": str(self.master_port),
        }


def slurm_port(job_id: int) -> int:
    """A port every task of a job derives alike; jobs with nearby ids get different ports."""
    return PORT_BASE + job_id % PORT_SPAN


def tasks_per_node(spec: str) -> list[int]:
    """Expand Slurm's compressed task counts: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if match is None:
            raise LaunchError(f"cannot parse SLURM_STEP_TASKS_PER_NODE={spec!r} (expected e.g. '2(x3),1')")
        counts += [int(match[1])] * int(match[2] or 1)
    return counts


def _run_scontrol(*args: str) -> str:
    try:
        return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True, timeout=60).stdout
    except FileNotFoundError:
        raise LaunchError(
            "scontrol not found on PATH: the Slurm client tools are needed to find the master "
            "node (or export MASTER_ADDR yourself)"
        ) from None
    except subprocess.CalledProcessError as err:
        raise LaunchError(f"scontrol {' '.join(args)} failed: {err.stderr.strip()}") from None


def master_address(nodelist: str, scontrol: Callable[..., str] = _run_scontrol) -> str:
    """The address of the first node of ``nodelist``: its host name when it resolves, else Slurm's NodeAddr
    (node names need not be host names, e.g. several slurmd on one host)."""
    hosts = scontrol("show", "hostnames", nodelist).split()
    if not hosts:
        raise LaunchError(f"scontrol show hostnames {nodelist!r} returned no host")
    first = hosts[0]
    try:
        socket.getaddrinfo(first, None)
        return first
    except socket.gaierror:
        pass
    match = re.search(r"\bNodeAddr=(\S+)", scontrol("show", "node", first, "-o"))
    if match is None:
        raise LaunchError(f"node {first} does not resolve and scontrol shows no NodeAddr for it; export MASTER_ADDR")
    return match[1]


def _int(env: Mapping[str, str], name: str) -> int:
    value = env.get(name)
    if value is None:
        raise LaunchError(f"{name} is not set although this looks like a launched task")
    try:
        return int(value)
    except ValueError:
        raise LaunchError(f"{name}={value!r} is not an integer") from None


def from_torchrun(env: Mapping[str, str]) -> DistEnv:
    missing = [name for name in TORCHRUN_VARS if name not in env]
    if missing:
        raise LaunchError(
            f"RANK/WORLD_SIZE are set but {', '.join(missing)} not: start with torchrun, "
            "or set all of " + ", ".join(TORCHRUN_VARS)
        )
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if not 0 <= rank < world:
        raise LaunchError(f"RANK={rank} is outside WORLD_SIZE={world}")
    local_world = int(env.get("LOCAL_WORLD_SIZE", world))
    return DistEnv(
        "torchrun", rank, _int(env, "LOCAL_RANK"), world, local_world, env["MASTER_ADDR"], _int(env, "MASTER_PORT")
    )


def from_slurm(env: Mapping[str, str], scontrol: Callable[..., str] = _run_scontrol) -> DistEnv:
    rank, local_rank, world = _int(env, "SLURM_PROCID"), _int(env, "SLURM_LOCALID"), _int(env, "SLURM_STEP_NUM_TASKS")
    if not 0 <= rank < world:
        raise LaunchError(f"SLURM_PROCID={rank} is outside SLURM_STEP_NUM_TASKS={world}")
    node_id = _int(env, "SLURM_NODEID")
    per_node = tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(world)))
    local_world = per_node[node_id] if node_id < len(per_node) else 1
    # an address/port exported by the user (sbatch --export) wins over the derived ones
    addr = env.get("MASTER_ADDR") or master_address(
        env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"], scontrol
    )
    port = _int(env, "MASTER_PORT") if env.get("MASTER_PORT") else slurm_port(_int(env, "SLURM_JOB_ID"))
    return DistEnv("slurm", rank, local_rank, world, local_world, addr, port)


def detect(env: Mapping[str, str] | None = None, scontrol: Callable[..., str] = _run_scontrol) -> DistEnv:
    """The distributed layout of this process, from torchrun's or Slurm's variables, or a single process."""
    env = os.environ if env is None else env
    if "RANK" in env or "WORLD_SIZE" in env or "TORCHELASTIC_RUN_ID" in env:
        return from_torchrun(env)
    if "SLURM_STEP_ID" in env and "SLURM_PROCID" in env:
        return from_slurm(env, scontrol)
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        return DistEnv(
            "single",
            note=f"Slurm job {env['SLURM_JOB_ID']} has {env['SLURM_NTASKS']} tasks but this "
            "process was not started by srun: running one process (use "
            "`srun python -m launch ...` to start one per task)",
        )
    return DistEnv("single")
