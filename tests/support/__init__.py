"""Helpers the test files share (importable as ``support``: pytest's ``pythonpath`` names ``tests``).

``runs``: real ``megatransformer`` processes and the files a run writes; ``ranks``: in-process gloo ranks forked
from a server that has imported torch once; ``models``: tiny in-process models;
``attention``: attention inputs and masks for comparing cores; ``flash_reference``: flash-attn's contract
on CPU; ``data``: loader batches; ``shard_server``: shards over loopback HTTP; ``loopback``: HTTP servers on
loopback that stop at once.
"""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def assert_one_line(err: str, *fragments: str) -> None:
    """A refusal's stderr: one line, no traceback, holding every fragment."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
