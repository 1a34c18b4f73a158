"""One run at a time in a run directory: RUN_DIR/run.lock, an OS file lock (POSIX, ``fcntl.lockf``) that the
first rank holds for the run's life, with the holder's host and pid inside. Design: docs/checkpoints.md."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from megatransformer.checkpoint import warn
from megatransformer.config import ConfigError

LOCK = "run.lock"
# What names the job a holder belongs to, in this order (a Slurm requeue keeps its job id).
JOB_VARIABLES = ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")


@dataclass
class RunDirLock:
    """The held lock. A POSIX lock belongs to the process and ends with it (killed or not); the process must
    open no other descriptor of the file while it holds it (closing any would release the lock)."""

    path: Path
    fd: int

    def release(self) -> None:
        """Empty the record (a free lock: the next run takes it without a word), then release the lock."""
        if self.fd < 0:
            return
        try:
            os.ftruncate(self.fd, 0)
        finally:
            os.close(self.fd)  # (releases the lock)
            self.fd = -1


def holder_record() -> dict[str, object]:
    """What the lock file says about its holder: host, pid, start time, and the job (Slurm, torchrun)."""
    job = next((f"{name}={os.environ[name]}" for name in JOB_VARIABLES if os.environ.get(name)), None)
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.strftime("%Y-%m-%d %H:%M:%S"), "job": job}


def describe_holder(record: dict[str, object] | None) -> str:
    if not record:
        return "a process that left no record"
    job = f", {record['job']}" if record.get("job") else ""
    return f"pid {record.get('pid')} on host {record.get('host')}{job}, since {record.get('started')}"


def lock_run_dir(run_dir: str | Path) -> RunDirLock | None:
    """Take RUN_DIR's lock before the run writes anything there, or raise a ConfigError naming the run that
    holds it. A record left by a holder that is gone (killed, requeued, restarted by torchrun) is taken over
    with a warning. None (with a warning) where the file system has no locks."""
    run_dir = Path(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise ConfigError(f"run_dir={run_dir} is a file, not a directory; choose another run_dir") from None
    path = run_dir / LOCK
    fd = _open_lock_file(path)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        left = _read(fd)
        os.close(fd)
        if err.errno in (errno.EACCES, errno.EAGAIN):
            raise ConfigError(
                f"run_dir={run_dir} is in use by another run ({describe_holder(left)}; lock {path}); wait for it "
                "to end or stop it, or choose another run_dir"
            ) from None
        warn(
            f"{path}: the file system of run_dir has no file locks ({err.strerror}): a second run started on "
            f"run_dir={run_dir} would not be stopped"
        )
        return None
    previous = _read(fd)
    if previous and previous.get("pid") != os.getpid():  # (not a record this very process left)
        warn(f"{path}: taking over the lock of {describe_holder(previous)}, {_why_gone(previous)}")
    record = json.dumps(holder_record()).encode() + b"\n"
    os.ftruncate(fd, 0)
    os.pwrite(fd, record, 0)
    os.fsync(fd)
    return RunDirLock(path, fd)


def _open_lock_file(path: Path) -> int:
    """The lock file opened for writing, which must be a regular file of its own: a link (symbolic or hard) or
    any other kind of file would have the run's record written, and truncated, elsewhere."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as err:
        what = {errno.ELOOP: "a symbolic link", errno.EISDIR: "a directory"}.get(err.errno, err.strerror)
        raise ConfigError(f"{path} is {what}, not a lock file; remove it (the run writes its lock there)") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
        os.close(fd)
        what = "a file with other names (a hard link)" if stat.S_ISREG(info.st_mode) else "not a regular file"
        raise ConfigError(f"{path} is {what}, not a lock file; remove it (the run writes its lock there)")
    return fd


def _read(fd: int) -> dict[str, object] | None:
    """The record in the lock file; None when it is empty (released); a record that is not one reads as such."""
    raw = os.pread(fd, 4096, 0)
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
        return record if isinstance(record, dict) else {"pid": "?", "host": "?", "started": "? (unreadable record)"}
    except ValueError:
        return {"pid": "?", "host": "?", "started": "? (unreadable record)"}


def _why_gone(record: dict[str, object]) -> str:
    """Why a record whose lock is free belongs to a run that ended without releasing it."""
    pid, host = record.get("pid"), record.get("host")
    if host != socket.gethostname():
        return (
            "which ended without releasing it (its file lock is free; a process on another host cannot be checked "
            "from here: if that run is still going, stop this one)"
        )
    if isinstance(pid, int) and _alive(pid):
        return f"whose lock is free although pid {pid} is running (a pid used again by another program)"
    return "which ended without releasing it (killed, requeued or restarted)"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
