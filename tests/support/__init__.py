"""Helpers the test files share (importable as ``support``: pytest's ``pythonpath`` names ``tests``).

``runs``: real ``megatransformer`` processes and the files a run writes; ``ranks``: in-process gloo ranks forked
from a server that has imported torch once; ``models``: tiny in-process models;
``attention``: attention inputs and masks for comparing cores; ``flash_reference``: flash-attn's contract
on CPU; ``data``: loader batches; ``shard_server``: shards over loopback HTTP; ``loopback``: HTTP servers on
loopback that stop at once.
"""

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


@contextlib.contextmanager
def bench_script(name: str) -> Iterator[ModuleType]:
    """``bench/NAME.py`` imported as the module ``NAME``, in ``sys.modules`` while it is used (its dataclasses look
    their module up there)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules[name]


def assert_one_line(err: str, *fragments: str) -> None:
    """A refusal's stderr: one line, no traceback, holding every fragment."""
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
