"""A corpus every machine with Python already has: the standard library's docstrings.

Used by the quick start and the tests, so nothing is downloaded and no third-party text is committed.
Read from the source files with ``ast`` (no imports, no side effects), in a fixed order: deterministic.
"""

from __future__ import annotations

import ast
import inspect
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

MIN_CHARS = 200


SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "__pycache__", "idle_test"}


def stdlib_files() -> Iterator[Path]:
    """The standard library's .py files in a fixed order, without installed packages and test suites."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS)
        for name in sorted(files):
            if name.endswith(".py"):
                yield Path(root) / name


def stdlib_docstrings(min_chars: int = MIN_CHARS) -> Iterator[str]:
    for path in stdlib_files():
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc and len(doc) >= min_chars:
                    yield inspect.cleandoc(doc)


def write_demo_corpus(out: str | Path, max_bytes: int = 2_000_000) -> Path:
    """Write docstrings as blank-line-separated documents (inner blank lines folded) up to ``max_bytes``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    size, docs = 0, []
    for doc in stdlib_docstrings():
        text = "\n".join(line for line in doc.splitlines() if line.strip())
        docs.append(text)
        size += len(text.encode()) + 2
        if size >= max_bytes:
            break
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    tmp.replace(out)
    return out
