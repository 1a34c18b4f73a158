"""A rank's failure told to the other ranks at once, through the store their process group started from.

Under NCCL a rank learns that a peer has failed only when its next collective times out (parallel.timeout_minutes,
30 by default), so a rank that stops with an error would leave every other rank of the job waiting that long;
torchrun's agents end a failed job's other processes, but srun (the shipped Slurm script) does not. The rank
that fails posts one line on the board (a key of the TCP store at MASTER_ADDR:MASTER_PORT); every rank reads the
board every few seconds from a thread of its own and, finding another rank's line, ends itself with it. A rank
killed outright (SIGKILL, the kernel's out-of-memory killer, a lost node) posts nothing: its peers wait for the
timeout, with the hang watchdog's stacks and NCCL's flight recorder.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta

KEY = "megatransformer/failure"
ENDED = "megatransformer/ended"
POLL_SECONDS = 5.0  # how often each rank reads the board: a round trip to the store's host
STORE_TIMEOUT = timedelta(seconds=10)


class FailureBoard:
    """This job's board (:meth:`connect`): :meth:`post` a failure, :meth:`read` it, :meth:`watch` for one."""

    def __init__(self, store, rank: int, world_size: int, attempt: str = "0") -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        # (torchrun's agent keeps its store across restarts: each attempt has its own keys)
        self.key, self.ended = f"{KEY}/{attempt}", f"{ENDED}/{attempt}"
        self.closing = threading.Event()
        self.thread: threading.Thread | None = None

    @classmethod
    def connect(cls) -> FailureBoard | None:
        """A client of the job's store, from the environment the process group started from; None for one rank."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return None
        import torch.distributed as dist

        from megatransformer.console import to_stderr

        where = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        try:
            store = dist.TCPStore(
                os.environ["MASTER_ADDR"],
                int(os.environ["MASTER_PORT"]),
                is_master=False,
                timeout=STORE_TIMEOUT,
                wait_for_workers=False,
            )
        except (RuntimeError, OSError) as err:
            to_stderr(
                f"warning: the job's store at {where} does not answer ({str(err).strip().splitlines()[0]}): should a "
                "rank fail, the others wait parallel.timeout_minutes before they end"
            )
            return None
        return cls(store, int(os.environ["RANK"]), world, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))

    def post(self, line: str) -> None:
        """This rank failed with ``line``; the first rank to post is the one the others name."""
        try:
            self.store.compare_set(self.key, "", f"rank {self.rank}: {line}")
        except (RuntimeError, OSError):  # (the store's host is gone: its rank failed first)
            pass

    def read(self) -> str | None:
        """``rank R: line`` of the rank that failed first, or None (none has, or the store no longer answers)."""
        try:
            return self.store.get(self.key).decode() if self.store.check([self.key]) else None
        except (RuntimeError, OSError):
            return None

    def watch(self, on_failure: Callable[[str], object]) -> None:
        """From now on, every :data:`POLL_SECONDS`, ``on_failure(line)`` once another rank has posted ``line``."""
        self.thread = threading.Thread(
            target=self._watch, args=(on_failure,), name="megatransformer-failure-board", daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        """Stop watching."""
        self.closing.set()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join()

    def close(self, failed: bool = False) -> None:
        """Stop watching, and say this rank has ended. The rank whose process holds the store (rank 0 under srun)
        waits, after a failure, until the others have ended or read the board (at most :data:`POLL_SECONDS` and a
        second): its exit takes the store, and the line, with it."""
        self.stop()
        try:
            self.store.add(self.ended, 1)
            if failed and self.rank == 0 and "TORCHELASTIC_RUN_ID" not in os.environ:
                deadline = time.monotonic() + POLL_SECONDS + 1
                while self.store.add(self.ended, 0) < self.world_size and time.monotonic() < deadline:
                    time.sleep(0.1)
        except (RuntimeError, OSError):
            pass

    def _watch(self, on_failure: Callable[[str], object]) -> None:
        while not self.closing.wait(POLL_SECONDS):
            line = self.read()
            if line is not None and not line.startswith(f"rank {self.rank}:"):
                try:
                    self.store.add(self.ended, 1)
                except (RuntimeError, OSError):
                    pass
                on_failure(line)
                return
