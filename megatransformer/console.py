"""Lines on stderr, each in one write: the ranks of a run share the stream, and ``print``'s two writes (the text,
then the newline) interleave with another rank's into one garbled line. What DeepSpeed prints while it starts,
held back from stdout."""

from __future__ import annotations

import contextlib
import io
import sys
from collections.abc import Iterator


def to_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


@contextlib.contextmanager
def held_stdout(verbose: bool = False) -> Iterator[None]:
    """Hold back what DeepSpeed prints on stdout while it starts (its accelerator's warning, ``deepspeed_shm_comm_op
    built successfully`` and the like) unless ``verbose``: stdout stays the command's own (a table, ``--json``).
    If start-up fails unexpectedly, what was held goes to stderr with the error (a bad config or input is its own
    one line: exit 2)."""
    from data_pipeline import DataError
    from megatransformer.config import ConfigError

    if verbose:
        yield
        return
    held = io.StringIO()
    try:
        with contextlib.redirect_stdout(held):
            yield
    except (ConfigError, DataError):
        raise
    except BaseException:
        sys.stderr.write(held.getvalue())
        raise
