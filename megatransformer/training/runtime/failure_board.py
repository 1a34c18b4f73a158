"""A rank's failure told to the other ranks at once, through the store their process group started from.

Under NCCL a rank learns that a peer has failed only when its next collective times out (parallel.timeout_minutes,
30 by default), so a rank that stops with an error would leave every other rank of the job waiting that long;
torchrun's agents end a failed job's other processes, but srun (the shipped Slurm script) does not. The rank
that fails posts one line on the board (a key of the TCP store at MASTER_ADDR:MASTER_PORT); every rank reads the
board every few seconds from a thread of its own and, finding another rank's line, ends itself with it.

A rank killed outright (SIGKILL, the kernel's out-of-memory killer) posts nothing, so each rank also says on the
board which process it is, and the ranks of one machine look after each other: a peer whose process is gone
without having ended its run is posted, by the first rank to see it, as having ended without a line. What that
cannot see (a lost node; the store's own host, rank 0 under srun, killed) leaves its peers waiting for the
timeout, with the hang watchdog's stacks and NCCL's flight recorder.

Before the process group starts, the same store (torchrun's agent's) tells a machine's ranks that its first rank
has printed the config or data error they all found (:func:`say_printed`, :func:`wait_until_printed`).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

KEY = "megatransformer/failure"
ENDED = "megatransformer/ended"
PROCESS = "megatransformer/process"
POLL_SECONDS = 5.0  # how often each rank reads the board: a round trip to the store's host
STORE_HOST_WAIT_SECONDS = 3 * POLL_SECONDS  # (a busy machine's watcher threads may each read late)
STORE_TIMEOUT = timedelta(seconds=10)
PRINTED = "megatransformer/printed"
PRINTED_WAIT_SECONDS = 120.0  # (costs nothing where it is used: torchrun ends the waiting rank as the printer exits)


class FailureBoard:
    """This job's board (:meth:`connect`): :meth:`post` a failure, :meth:`read` it, :meth:`watch` for one."""

    def __init__(self, store, rank: int, world_size: int, attempt: str = "0", machine: range | None = None) -> None:
        """``machine``: the ranks that may share this rank's machine (all where None); the others are not watched."""
        self.store, self.rank, self.world_size = store, rank, world_size
        self.machine = range(world_size) if machine is None else machine
        # (torchrun's agent keeps its store across restarts: each attempt has its own keys)
        self.key, self.ended, self.process = f"{KEY}/{attempt}", f"{ENDED}/{attempt}", f"{PROCESS}/{attempt}"
        self.closing = threading.Event()
        self.thread: threading.Thread | None = None
        self.neighbours: dict[int, Process | None] = {}  # each peer's process where this rank can see it, else None

    @classmethod
    def connect(cls, local_rank: int) -> FailureBoard | None:
        """A client of the job's store, from the environment the process group started from, for the rank
        ``local_rank`` on its node; None for one rank."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world == 1:
            return None
        from megatransformer.console import to_stderr

        try:
            store = job_store()
        except (RuntimeError, OSError) as err:
            to_stderr(
                f"warning: the job's store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} does not answer "
                f"({str(err).strip().splitlines()[0]}): should a rank fail, the others wait "
                "parallel.timeout_minutes before they end"
            )
            return None
        rank = int(os.environ["RANK"])
        machine = range(first_rank_of_machine(local_rank), first_rank_of_machine(local_rank) + local_world_size())
        return cls(store, rank, world, attempt(), machine)

    def post(self, line: str, rank: int | None = None) -> None:
        """This rank (or ``rank``, seen gone) failed with ``line``; the first post is the one the others read."""
        try:
            self.store.compare_set(self.key, "", f"rank {self.rank if rank is None else rank}: {line}")
        except (RuntimeError, OSError):  # (the store's host is gone: its rank failed first)
            pass

    def read(self) -> str | None:
        """``rank R: line`` of the rank that failed first, or None (none has, or the store no longer answers)."""
        try:
            return self.store.get(self.key).decode() if self.store.check([self.key]) else None
        except (RuntimeError, OSError):
            return None

    def watch(self, on_failure: Callable[[str], object]) -> None:
        """From now on, every :data:`POLL_SECONDS`, ``on_failure(line)`` once another rank has posted ``line``, or
        this rank has seen a peer on its machine gone without a word (and posted that for the others)."""
        me = Process.of(os.getpid())
        if me is not None:
            try:
                self.store.set(f"{self.process}/{self.rank}", str(me))
            except (RuntimeError, OSError):
                pass
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
        waits, after a failure, until the others have ended or read the board (at most
        :data:`STORE_HOST_WAIT_SECONDS`): its exit takes the store, and the line, with it."""
        self.stop()
        try:
            self._say_ended()
            if failed and self.rank == 0 and "TORCHELASTIC_RUN_ID" not in os.environ:
                everyone = [f"{self.ended}/{rank}" for rank in range(self.world_size)]
                deadline = time.monotonic() + STORE_HOST_WAIT_SECONDS
                while not self.store.check(everyone) and time.monotonic() < deadline:
                    time.sleep(0.1)
        except (RuntimeError, OSError):
            pass

    def gone(self) -> str | None:
        """``rank R: line`` for the first peer on this machine whose process has gone without ending its run (that
        line posted for the others), or None."""
        self._meet_neighbours()
        for rank, process in sorted(self.neighbours.items()):
            # (gone first, then not ended: a rank says it ended before its process goes)
            if process is not None and not process.running() and self._not_ended(rank):
                line = f"its process ended without a line ({process.described()})"
                self.post(line, rank=rank)
                return f"rank {rank}: {line}"
        return None

    def _watch(self, on_failure: Callable[[str], object]) -> None:
        try:
            self._poll(on_failure)
        except Exception as err:  # (a thread's error would end it unseen)
            from megatransformer.console import to_stderr

            to_stderr(
                f"warning: rank {self.rank}: the failure board's watcher stopped ({type(err).__name__}: {err}): "
                "should another rank fail, this one waits parallel.timeout_minutes before it ends"
            )

    def _poll(self, on_failure: Callable[[str], object]) -> None:
        while not self.closing.wait(POLL_SECONDS):
            line = self.read() or self.gone()
            if line is not None and not line.startswith(f"rank {self.rank}:"):
                try:
                    self._say_ended()
                except (RuntimeError, OSError):
                    pass
                on_failure(self.read() or line)  # (the first post, should another rank's have come first)
                return

    def _say_ended(self) -> None:
        self.store.set(f"{self.ended}/{self.rank}", "")

    def _not_ended(self, rank: int) -> bool:
        """Whether ``rank`` is known not to have ended its run (False where the store cannot tell)."""
        try:
            return not self.store.check([f"{self.ended}/{rank}"])
        except (RuntimeError, OSError):
            return False

    def _meet_neighbours(self) -> None:
        """Learn, once each, the process of every peer that has said which it is: kept where this rank can watch
        it (the same machine and process namespace), None otherwise."""
        unmet = [rank for rank in self.machine if rank != self.rank and rank not in self.neighbours]
        me = Process.of(os.getpid()) if unmet else None
        for rank in unmet:
            key = f"{self.process}/{rank}"
            try:
                if not self.store.check([key]):
                    continue
                said = self.store.get(key).decode()
            except (RuntimeError, OSError):
                return
            theirs = Process.parse(said)
            self.neighbours[rank] = theirs if me is not None and theirs is not None and theirs.beside(me) else None


def job_store(timeout: timedelta | None = None):
    """A client of the job's TCP store at MASTER_ADDR:MASTER_PORT (torchrun's agent's, or rank 0's once its
    process group has started), waiting ``timeout`` (default :data:`STORE_TIMEOUT`) for an answer; RuntimeError or
    OSError where none comes."""
    import torch.distributed as dist

    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    wait = STORE_TIMEOUT if timeout is None else timeout
    return dist.TCPStore(address, port, is_master=False, timeout=wait, wait_for_workers=False)


def attempt() -> str:
    """This job's attempt: torchrun's agent keeps its store across restarts, so each attempt has its own keys."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")


def first_rank_of_machine(local_rank: int) -> int:
    """(torchrun and srun's default block distribution number a machine's ranks in a row.)"""
    return int(os.environ.get("RANK", "0")) - local_rank


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


# An error found before the process group starts is the same on each rank of a machine, and its first local rank
# prints it; torchrun ends a job's other processes as soon as one exits with an error (it looks every 0.1 s), so
# the others exit only once it has printed, or torchrun could end it first.


def say_printed() -> None:
    """(The first local rank under torchrun, its error printed.) Its machine's other ranks may exit now."""
    if not _under_torchrun():
        return
    try:
        job_store().set(_printed_key(), "")
    except (RuntimeError, OSError):
        pass


def wait_until_printed() -> None:
    """(Another local rank under torchrun, with the same error.) Return once the first local rank has printed it,
    or after :data:`PRINTED_WAIT_SECONDS` (a first rank that found no error); at once elsewhere."""
    if not _under_torchrun():
        return
    try:
        job_store(timedelta(seconds=PRINTED_WAIT_SECONDS)).wait([_printed_key()])
    except (RuntimeError, OSError):
        pass


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ and "MASTER_ADDR" in os.environ and local_world_size() > 1


def _printed_key() -> str:
    return f"{PRINTED}/{attempt()}/{first_rank_of_machine(int(os.environ.get('LOCAL_RANK', '0')))}"


class Process:
    """A process as Linux's /proc names it, across machines: the boot (which machine, which start of it), the PID
    namespace, the pid and its start time (a pid is used again once its process is gone)."""

    def __init__(self, boot: str, namespace: str, pid: int, started: str, host: str) -> None:
        self.boot, self.namespace, self.pid, self.started, self.host = boot, namespace, pid, started, host

    @classmethod
    def of(cls, pid: int) -> Process | None:
        """Process ``pid`` of this machine and PID namespace; None where it has none or /proc does not say (not
        Linux)."""
        try:
            boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
            namespace = os.readlink("/proc/self/ns/pid")
        except OSError:
            return None
        stat = _stat(pid)
        return None if stat is None else cls(boot, namespace, pid, stat[1], socket.gethostname())

    @classmethod
    def parse(cls, text: str) -> Process | None:
        """The process ``str(process)`` said; None for any other text."""
        fields = text.split(" ", 4)
        if len(fields) != 5 or not fields[2].isdigit():
            return None
        boot, namespace, pid, started, host = fields
        return cls(boot, namespace, int(pid), started, host)

    def __str__(self) -> str:
        return f"{self.boot} {self.namespace} {self.pid} {self.started} {self.host}"

    def beside(self, other: Process) -> bool:
        """Whether ``other`` sees this process in its /proc (the same machine, booted once, and PID namespace)."""
        return (self.boot, self.namespace) == (other.boot, other.namespace)

    def running(self) -> bool:
        """False once the process has ended (a zombie has: only its parent's reading of its exit is left)."""
        stat = _stat(self.pid)
        return stat is not None and stat[1] == self.started and stat[0] not in "ZX"

    def described(self) -> str:
        return (
            f"pid {self.pid} on {self.host}: killed, as by the kernel's out-of-memory killer (dmesg lists those), or "
            "aborted, as by NCCL's watchdog after a failed collective (its log says)"
        )


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of process ``pid`` from /proc/PID/stat, or None where there is none."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2 :].split()  # (after the name, which may hold spaces and brackets)
    return (fields[0], fields[19]) if len(fields) > 19 else None
