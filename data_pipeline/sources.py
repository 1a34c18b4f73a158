"""Reading raw documents: .txt (one document per blank-line-separated block, or per file) and .jsonl
(one document per line, from a configurable field), optionally .gz / .zst compressed."""

from __future__ import annotations

import codecs
import gzip
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

from data_pipeline import DataError


@dataclass
class Document:
    text: str
    source: str
    line: int


@dataclass
class DecodeStats:
    replaced_lines: int = 0


def _open_binary(path: Path) -> IO[bytes]:
    if path.suffix == ".gz":
        return gzip.open(path, "rb")
    if path.suffix == ".zst":
        import zstandard

        return zstandard.ZstdDecompressor().stream_reader(open(path, "rb"))
    return open(path, "rb")


def _lines(path: Path, on_decode_error: str, stats: DecodeStats) -> Iterator[tuple[int, str]]:
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    with _open_binary(path) as raw:
        for number, line in enumerate(io.BufferedReader(raw), start=1):
            try:
                yield number, decoder.decode(line)
            except UnicodeDecodeError as err:
                if on_decode_error == "fail":
                    raise DataError(f"{path}:{number}: not UTF-8 ({err.reason} at byte {err.start}); "
                                    "fix the file or pass --on-decode-error replace") from None
                decoder.reset()
                stats.replaced_lines += 1
                yield number, line.decode("utf-8", errors="replace")


def _kind(path: Path) -> str:
    name = path.name.removesuffix(".gz").removesuffix(".zst")
    if name.endswith(".jsonl") or name.endswith(".json"):
        return "jsonl"
    return "txt"


def read_documents(
    files: list[str | Path],
    text_field: str = "text",
    doc_per: str = "block",
    on_decode_error: str = "replace",
    stats: DecodeStats | None = None,
) -> Iterator[Document]:
    """Yield documents from the files in order; empty documents are dropped."""
    stats = stats or DecodeStats()
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"input file {path} does not exist")
        lines = _lines(path, on_decode_error, stats)
        if _kind(path) == "jsonl":
            yield from _jsonl_documents(path, lines, text_field)
        elif doc_per == "file":
            text = "".join(line for _, line in lines).strip()
            if text:
                yield Document(text, str(path), 1)
        else:
            yield from _block_documents(path, lines)


def _block_documents(path: Path, lines) -> Iterator[Document]:
    block: list[str] = []
    start = 1
    for number, line in lines:
        if line.strip():
            if not block:
                start = number
            block.append(line.rstrip("\n"))
        elif block:
            yield Document("\n".join(block), str(path), start)
            block = []
    if block:
        yield Document("\n".join(block), str(path), start)


def _jsonl_documents(path: Path, lines, text_field: str) -> Iterator[Document]:
    for number, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: invalid JSON ({err.msg})") from None
        if not isinstance(record, dict) or text_field not in record:
            raise DataError(f"{path}:{number}: no {text_field!r} field; choose one with --text-field")
        text = str(record[text_field]).strip()
        if text:
            yield Document(text, str(path), number)
