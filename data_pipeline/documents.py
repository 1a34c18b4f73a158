"""Reading raw documents: .txt (one document per blank-line-separated block, or per file) and .jsonl
(one document per line, from a configurable field), optionally .gz / .zst compressed.

Instruction data: with ``prompt_field`` set, every .jsonl record is one (prompt, completion) example; the
completion comes from ``text_field``. Neither is stripped: the whitespace between them is the user's choice.
Translation pairs are such examples (source = prompt, target = completion); they may also come from .tsv
files: one pair per line, tab-separated, no quoting. If the first line's columns include both field names, it
is a header and those columns are read; otherwise every line has exactly two columns, source then target.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from data_pipeline import DataError


@dataclass
class Document:
    text: str  # the whole document, or the completion of an instruction example
    file: str  # the input file it was read from
    line: int
    prompt: str | None = None  # the prompt of an instruction example (loss on `text` only)


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
                    raise DataError(
                        f"{path}:{number}: not UTF-8 ({err.reason} at byte {err.start}); "
                        "fix the file or pass --on-decode-error replace"
                    ) from None
                decoder.reset()
                stats.replaced_lines += 1
                yield number, line.decode("utf-8", errors="replace")


def _kind(path: Path) -> str:
    name = path.name.removesuffix(".gz").removesuffix(".zst")
    if name.endswith(".jsonl") or name.endswith(".json"):
        return "jsonl"
    if name.endswith(".tsv"):
        return "tsv"
    return "txt"


INPUT_SUFFIXES = (".txt", ".jsonl", ".json", ".tsv")


def input_files(names: list[str]) -> list[str]:
    """``--input`` as files: a directory stands for its files of the kinds read here (.txt, .jsonl, .json,
    .tsv, plain or .gz / .zst), in name order; a file is kept as given."""
    files: list[str] = []
    for name in names:
        path = Path(name)
        if not path.is_dir():
            files.append(name)
            continue
        found = sorted(
            str(p)
            for p in path.iterdir()
            if p.is_file() and p.name.removesuffix(".gz").removesuffix(".zst").endswith(INPUT_SUFFIXES)
        )
        if not found:
            raise DataError(f"input directory {path} holds no .txt, .jsonl, .json or .tsv files (plain, .gz or .zst)")
        files += found
    return files


def read_documents(
    files: list[str | Path],
    text_field: str = "text",
    doc_per: str = "block",
    on_decode_error: str = "replace",
    stats: DecodeStats | None = None,
    prompt_field: str | None = None,
) -> Iterator[Document]:
    """Yield documents from the files in order; empty documents are dropped. With ``prompt_field``, yield
    instruction examples (``.jsonl`` or ``.tsv``)."""
    stats = stats or DecodeStats()
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise DataError(f"input file {path} does not exist")
        lines = _lines(path, on_decode_error, stats)
        if prompt_field is not None:
            if _kind(path) == "tsv":
                yield from _tsv_examples(path, lines, prompt_field, text_field)
                continue
            if _kind(path) != "jsonl":
                raise DataError(
                    f"{path}: prompt/completion (source/target) examples are read from .jsonl and .tsv files only"
                )
            yield from _instruction_examples(path, lines, prompt_field, text_field)
        elif _kind(path) == "jsonl":
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


def _records(path: Path, lines) -> Iterator[tuple[int, dict]]:
    for number, line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{path}:{number}: invalid JSON ({err.msg})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        yield number, record


def _jsonl_documents(path: Path, lines, text_field: str) -> Iterator[Document]:
    for number, record in _records(path, lines):
        if text_field not in record:
            raise DataError(f"{path}:{number}: no {text_field!r} field; choose one with --text-field")
        text = str(record[text_field]).strip()
        if text:
            yield Document(text, str(path), number)


def _instruction_examples(path: Path, lines, prompt_field: str, completion_field: str) -> Iterator[Document]:
    for number, record in _records(path, lines):
        for name, option in ((prompt_field, "--prompt-field"), (completion_field, "--completion-field")):
            if not isinstance(record.get(name), str):
                raise DataError(f"{path}:{number}: no string field {name!r}; choose the field with {option}")
        if record[prompt_field] or record[completion_field]:
            yield Document(record[completion_field], str(path), number, prompt=record[prompt_field])


def _tsv_examples(path: Path, lines, source_field: str, target_field: str) -> Iterator[Document]:
    """Pairs from a .tsv file (see the module docstring for the header rule)."""
    columns, width = (0, 1), 2
    for number, line in lines:
        cells = line.rstrip("\r\n").split("\t")
        if number == 1 and source_field in cells and target_field in cells:
            columns, width = (cells.index(source_field), cells.index(target_field)), len(cells)
            continue
        if not line.strip():
            continue
        if len(cells) != width:
            raise DataError(
                f"{path}:{number}: {len(cells)} tab-separated columns, expected {width} (source, "
                f"target; or a first line naming the columns {source_field!r} and {target_field!r})"
            )
        source, target = cells[columns[0]], cells[columns[1]]
        if source or target:
            yield Document(target, str(path), number, prompt=source)
