"""Lines on stderr, each in one write: the ranks of a run share the stream, and ``print``'s two writes (the text,
then the newline) interleave with another rank's into one garbled line."""

from __future__ import annotations

import sys


def to_stderr(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
