"""``python -m launch --config FILE [key.path=value ...]``: one entry point for torchrun, srun and plain runs.

The trainer initialises the process group itself (DeepSpeed: NCCL on GPUs, gloo on CPU) from the variables
exported here, handles SIGUSR1/SIGTERM by checkpointing and exits 124 ("preempted, requeue me"); see
launch/README.md for the contract with slurm/train.sbatch.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from launch.env import DistEnv, LaunchError, detect
from megatransformer.console import to_stderr

PREEMPTION_SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class EarlySignals:
    """Keep a preemption signal that arrives before the trainer installed its handler (imports and
    DeepSpeed start-up take seconds), and deliver it again once the trainer's handler is in place.

    Without this, SIGUSR1 during start-up would kill the process (its default action) and the job would
    end without a checkpoint or a requeue.
    """

    def __init__(self) -> None:
        self.pending: list[int] = []
        for sig in PREEMPTION_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame) -> None:
        self.pending.append(signum)
        if len(self.pending) == 1:  # the relay thread ends when nothing is pending
            threading.Thread(target=self._redeliver, daemon=True, name="launch-signal-relay").start()

    def _redeliver(self) -> None:
        while self.pending:
            signum = self.pending[0]
            if signal.getsignal(signum) != self._handle:  # someone took over: hand the signal on
                self.pending.pop(0)
                os.kill(os.getpid(), signum)
            else:
                time.sleep(0.2)


def describe(dist: DistEnv) -> str:
    if dist.launcher == "single":
        return "launch: single process"
    return (
        f"launch: {dist.launcher}: world {dist.world_size} ({dist.local_world_size} per node), "
        f"master {dist.master_addr}:{dist.master_port}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: python -m launch --config FILE [key.path=value ...]\n"
            "Runs `megatransformer train` under torchrun, srun, or as one process.",
            file=sys.stdout if argv else sys.stderr,
        )
        return 0 if argv else 2
    EarlySignals()
    try:
        dist = detect()
    except LaunchError as err:
        to_stderr(f"launch: error: {err}")
        return 2
    os.environ.update(dist.variables())
    if dist.note:
        to_stderr(f"launch: note: {dist.note}")
    if dist.rank == 0:
        print(describe(dist), flush=True)
    from megatransformer.cli import main as cli_main

    return cli_main(["train", *argv])


if __name__ == "__main__":
    from megatransformer.cli import end_process

    end_process(main())
