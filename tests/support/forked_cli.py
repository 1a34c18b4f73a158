"""``megatransformer`` runs forked from a server that has imported what every run imports (torch, dynamo,
DeepSpeed, the trainer): a test's run then costs its own work, not the ~5 CPU-seconds a new interpreter spends
importing them. Each rank is a process of its own with torchrun's rank variables (as ``srun`` starts ranks, so
without torchrun's TORCHELASTIC_* ones), stdin from /dev/null and its output in files, and ends through the
interpreter's shutdown as a process started from the command line does; when a rank fails, the others are
stopped as torchrun stops them. One server per test process, started at its first run, and again in the test
process's environment when that has changed (a library or an in-process test sets variables as it goes: DeepSpeed's
accelerator, the datasets library's offline flag); run as a script, this file is the server. ``runs.train`` and
``runs.cli`` use it where the run's environment is the server's or the test process's own."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path

# what a run imports before its first step, imported once by the server (tests/support's parent on sys.path)
PRELOAD = ("torch", "torch._dynamo", "deepspeed", "megatransformer.cli", "megatransformer.commands.train")
# the environment variables that may differ between the server's environment and a run's
PER_TEST = ("PYTEST_CURRENT_TEST",)
# how long the other ranks have to end after one failed before they are killed (torchrun's grace period)
GRACE_S = 30.0


def comparable(env: Mapping[str, str]) -> dict[str, str]:
    return {key: value for key, value in env.items() if key not in PER_TEST}


class ForkedCli:
    """The client: starts the server on its first run, asks it for runs one at a time."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a run in ``env`` can be forked: the environment the server started in, or this process's (a
        server is started in it), but for PER_TEST, since torch, DeepSpeed and OpenMP read theirs as they load;
        a run in an environment of its own starts a new interpreter. TESTS_FORK=0 turns forking off."""
        if os.environ.get("TESTS_FORK") == "0":
            return False
        return comparable(env) in (comparable(self._env), comparable(os.environ))

    def run(
        self, args: list[str], nproc: int = 1, timeout: float | None = None, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        """``megatransformer ARGS`` on ``nproc`` ranks to its end, in ``env`` (one :meth:`serves`; by default this
        process's): the first failed rank's exit code (0 when every rank exits 0), the ranks' standard output and
        error each in rank order. Past ``timeout`` s every rank and the server are killed and
        subprocess.TimeoutExpired raised, as subprocess.run raises it."""
        with self._lock, tempfile.TemporaryDirectory(prefix="forked_cli_") as outputs:
            server = self._started(dict(os.environ if env is None else env))
            request = {"args": [str(a) for a in args], "nproc": nproc, "cwd": os.getcwd(), "outputs": outputs}
            server.stdin.write(json.dumps(request) + "\n")
            server.stdin.flush()
            answer = self._answer(server, timeout)

            def read(stream: str) -> str:
                ranks = (Path(outputs, f"rank{rank}.{stream}") for rank in range(nproc))
                return "".join(path.read_text(errors="replace") for path in ranks if path.exists())

            command = ["megatransformer", *request["args"]]
            if answer is None:
                raise subprocess.TimeoutExpired(command, timeout, read("out"), read("err"))
            return subprocess.CompletedProcess(command, answer, read("out"), read("err"))

    def _started(self, env: dict[str, str]) -> subprocess.Popen:
        """The server, started (again) where there is none running in ``env``."""
        if self._server is not None and comparable(env) != comparable(self._env):
            self.close()
        if self._server is None or self._server.poll() is not None:
            self._env = env
            self._server = subprocess.Popen(
                [sys.executable, __file__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=self._env,
                start_new_session=True,  # (its ranks are in its process group: one killpg ends them all)
            )
        return self._server

    def _answer(self, server: subprocess.Popen, timeout: float | None) -> int | None:
        """The exit code the server answers, None past ``timeout`` (the server and its ranks killed then)."""
        ready, _, _ = select.select([server.stdout], [], [], timeout)
        line = server.stdout.readline() if ready else ""
        if line:
            return int(line)
        self.close()
        if ready:
            raise AssertionError(f"the forked CLI's server ended (exit {server.returncode}) during a run")
        return None

    def close(self) -> None:
        """Kills the server and any run it is serving."""
        if self._server is not None:
            try:
                os.killpg(self._server.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._server.wait()
            self._server = None


def serve() -> None:
    """The server: imports PRELOAD, then for each JSON request on stdin runs its ranks and writes the exit code."""
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (1, 2):  # (DeepSpeed prints as it loads; a rank's output goes to its own files)
        os.dup2(devnull, fd)
    sys.path[0] = str(Path(__file__).resolve().parents[2])  # (the repository, not tests/support)
    for name in PRELOAD:
        __import__(name)
    for line in sys.stdin:
        request = json.loads(line)
        answers.write(f"{run_ranks(request, answers, devnull)}\n")


def run_ranks(request: dict, answers, devnull: int) -> int:
    """Forks the request's ranks and waits for them: the first non-zero exit code, or 0."""
    from megatransformer.training.runtime.distributed import free_port

    nproc = request["nproc"]
    port = free_port() if nproc > 1 else None
    ranks = {fork_rank(request, rank, port, answers, devnull): rank for rank in range(nproc)}
    code, deadline = 0, None
    while ranks:
        pid, status = os.waitpid(-1, os.WNOHANG if deadline else 0)
        if pid == 0:
            if time.monotonic() > deadline:
                for other in ranks:
                    os.kill(other, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.05)
            continue
        if ranks.pop(pid, None) is None:
            continue
        exit_code = os.waitstatus_to_exitcode(status)
        if exit_code != 0 and code == 0:
            code, deadline = exit_code, time.monotonic() + GRACE_S
            for other in ranks:
                os.kill(other, signal.SIGTERM)
    return code


def fork_rank(request: dict, rank: int, port: int | None, answers, devnull: int) -> int:
    """The pid of a new process that becomes rank ``rank`` of the request; in that process, never returns: the
    command's SystemExit unwinds to the interpreter's shutdown."""
    pid = os.fork()
    if pid:
        return pid
    answers.close()
    os.dup2(devnull, 0)
    for fd, stream in ((1, "out"), (2, "err")):
        output = os.open(Path(request["outputs"], f"rank{rank}.{stream}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(output, fd)
        os.close(output)
    os.close(devnull)
    nproc = request["nproc"]
    if port is not None:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            GROUP_RANK="0",
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
    os.chdir(request["cwd"])
    from megatransformer import cli

    sys.argv = [cli.__file__, *request["args"]]
    cli.command()
    raise AssertionError("megatransformer.cli.command() returned")


if __name__ == "__main__":
    serve()
