"""Data preparation (tokenizer, shards, manifest) and the streaming training loader with its objectives."""

from __future__ import annotations

import errno
import re
import shutil
from pathlib import Path


class DataError(ValueError):
    """Bad or inconsistent data (input files, shards, manifest, tokenizer); the message says which and why."""


def schema_error(err) -> str:
    """``field.path: message`` of the first error of a pydantic ``ValidationError`` (of a record read from a
    file: a manifest, a part record)."""
    first = err.errors()[0]
    return f"{'.'.join(map(str, first['loc'])) or 'the record'}: {first['msg']}"


class WriteFailed(Exception):
    """Writing a run's or a dataset's files failed (a full disk, a quota, an I/O error); the message is one line:
    what failed, why, the free space there, and what is intact. Nothing half-written is left visible."""


# The errors of a write that are the storage's, whatever file: full, over quota, too large, read-only, I/O.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO})


def write_failed(what: str, where: str | Path, err: BaseException, intact: str = "") -> WriteFailed:
    """The one-line :class:`WriteFailed` for ``err`` (an OSError, or a library's error wrapping one) while
    ``what`` (e.g. "writing checkpoint step_000040") under ``where``; ``intact``: what is left safe."""
    line = f"{what} failed: {write_reason(err)} ({free_space(where)})"
    return WriteFailed(f"{line}; {intact}" if intact else line)


def free_space(where: str | Path) -> str:
    """ "N MiB free on PATH" for the file system holding ``where`` (its nearest existing directory)."""
    path = Path(where).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return f"free space on {path} unknown"
    return f"{free / 2**20:,.1f} MiB free on {path}"


def write_reason(err: BaseException) -> str:
    """The OS's reason for a failed write: an OSError's own, or the one inside a library's message (safetensors:
    ``I/O error: No space left on device (os error 28)``), else the message's first line."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    found = re.search(r'message: "([^"]+)"|I/O error: ([^(\n]+?) \(os error', str(err))
    if found:
        return found.group(1) or found.group(2)
    return (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
