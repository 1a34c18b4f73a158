"""The checkpoint directory: its file names, its step directories and `latest` pointer, and the one resolver of
a path a user gives for a checkpoint. Layout and trust model: docs/checkpoints.md."""

from __future__ import annotations

import errno
import functools
import os
import re
import shutil
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from pathlib import Path

from megatransformer.config import ConfigError
from megatransformer.console import to_stderr

COMPLETE = "COMPLETE"  # the manifest, written last: a directory without it is an interrupted save
WEIGHTS = "model.safetensors"
OPTIMIZER = "optimizer.safetensors"
TRAINER_STATE = "trainer.json"
CONFIG = "config.yaml"
TOKENIZER = "tokenizer.json"
LATEST = "latest"
# The files init_from, eval, generate and export read (the ones present are verified before use).
WEIGHTS_FILES = (WEIGHTS, CONFIG, TOKENIZER)
_STEP_DIR = re.compile(r"step_(\d+)")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def step_of(path: Path) -> int | None:
    """The step a step directory's name says, or None for any other name."""
    found = _STEP_DIR.fullmatch(path.name)
    return int(found.group(1)) if found else None


def rank_file(rank: int) -> str:
    """The per-rank state file (data-loader position, RNG states) of ``rank``."""
    return f"rank_{rank:05d}.pt"


def checkpoints_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def warn(message: str) -> None:
    """A warning on stderr, from the first rank only (every rank may take the same decision)."""
    if os.environ.get("RANK", "0") == "0":
        to_stderr(f"warning: {message}")


def complete_checkpoints(root: Path) -> list[Path]:
    """Step directories with a COMPLETE marker, newest (highest step) first; nothing else is read."""
    found = [p for p in root.glob("step_*") if step_of(p) is not None and (p / COMPLETE).is_file()]
    return sorted(found, key=step_of, reverse=True)


def latest_pointer(root: Path) -> tuple[Path | None, str | None]:
    """The complete checkpoint `latest` names, or (None, why it is ignored); (None, None) when there is none."""
    pointer = root / LATEST
    if not pointer.is_file():
        return None, None
    try:
        name = pointer.read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        return None, f"unreadable ({err.__class__.__name__})"
    if not _STEP_DIR.fullmatch(name):
        return None, f"holds {name[:40]!r}, not a step_NNNNNN name"
    if not (root / name / COMPLETE).is_file():
        return None, f"names {name}, which is not a complete checkpoint"
    return root / name, None


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names; should it be gone or unreadable, the newest complete one. Unverified."""
    named, _ = latest_pointer(root)
    if named is not None:
        return named
    complete = complete_checkpoints(root)
    return complete[0] if complete else None


def find_checkpoint(path: str | Path, what: str) -> Path:
    """The complete checkpoint a user's ``path`` means: a step directory, or the latest complete one of a
    checkpoints directory or of a run directory. Unverified; an error names ``what`` (e.g. ``resume=...``)."""
    path = Path(path)
    if not path.exists():
        raise ConfigError(f"{what} does not exist")
    if (path / COMPLETE).is_file():
        return path
    if step_of(path) is not None:
        raise ConfigError(
            f"{what} is not a complete checkpoint directory (no {COMPLETE} marker: a save "
            "that did not finish); take another one, or resume=auto for the latest complete one"
        )
    for root in (path, checkpoints_dir(path)):
        if root.is_dir() and ((root / LATEST).is_file() or any(root.glob("step_*"))):
            found = latest_checkpoint(root)
            if found is None:
                raise ConfigError(f"{what}: {root} holds no complete checkpoint (every save there was cut short)")
            return found
    if (path / "config.json").is_file() and any(path.glob("*.safetensors")):
        raise ConfigError(
            f"{what} is a Hugging Face model directory, not a checkpoint: convert it with `megatransformer import "
            f"--hf {path} --out CHECKPOINT` and give that checkpoint"
        )
    raise ConfigError(
        f"{what}: no complete checkpoint there (expected a step_NNNNNN directory, a run's "
        "checkpoints directory or a run directory)"
    )


def prune(root: Path, keep_last: int, keep: Collection[str]) -> None:
    """Remove all but the newest ``keep_last`` complete checkpoints (0: keep all), never those in ``keep``."""
    for old in complete_checkpoints(root)[keep_last:] if keep_last > 0 else []:
        if old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)


def complete_before(root: Path, step: int) -> list[Path]:
    """Complete checkpoints older than ``step``, newest first (unverified)."""
    return [p for p in complete_checkpoints(root) if step_of(p) < step]


def rewind_to(path: Path) -> None:
    """Make checkpoint ``path`` the newest of its run: newer ones (a trajectory a loss-spike rollback left)
    are deleted and `latest` names it. Rank 0 only."""
    for newer in complete_checkpoints(path.parent):
        if step_of(newer) > step_of(path):
            shutil.rmtree(newer, ignore_errors=True)
    atomic_write(path.parent / LATEST, path.name)


def atomic_write(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` whole, or (a failed write) leave it as it was; durable when it returns: the
    file fsynced before it is renamed into place, its directory after (a marker a crash cannot leave empty or
    unwritten once something was built on it)."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


@contextmanager
def replaced_when_written(out: Path, ours: Callable[[str], bool]) -> Iterator[Path]:
    """A new directory beside ``out`` to write into: when the block ends it replaces ``out`` (its rename made
    durable), and when the block raises it is removed, ``out`` left as it was. ``out`` may hold only files that
    ``ours`` accepts (what the same writer wrote there before): anything else is refused before a file is written,
    never deleted."""
    if out.exists() and not out.is_dir():
        raise ConfigError(f"{out} is a file; write to a new or empty directory")
    foreign = sorted(p.name for p in out.iterdir() if not (p.is_file() and ours(p.name))) if out.exists() else []
    if foreign:
        raise ConfigError(
            f"{out} holds {foreign[0]}, which this command does not write, and would be replaced: write to a new "
            "or empty directory"
        )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    fsync_dir(out.parent)


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable: fsync the directory itself (where
    the file system has no fsync of a directory, as some FUSE ones, its renames are as durable as it makes them)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as err:
        if err.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


@functools.cache
def default_file_mode() -> int:
    """0666 less the process umask. (Python can read the umask only by setting it: set it back at once,
    once per process.)"""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask
