"""Reading raw documents: .txt (one document per blank-line-separated block, or per file) and .jsonl
(one document per line, from a configurable field), optionally .gz / .zst compressed; .parquet and .arrow
(a Hugging Face ``datasets`` directory written by ``save_to_disk``): one document per row, from the column
named like a .jsonl field, streamed a record batch at a time.

Instruction data: with ``prompt_field`` set, every .jsonl record is one (prompt, completion) example; the
completion comes from ``text_field``. Neither is stripped: the whitespace between them is the user's choice.
Translation pairs are such examples (source = prompt, target = completion); they may also come from .tsv
files: one pair per line, tab-separated, no quoting. If the first line's columns include both field names, it
is a header and those columns are read; otherwise every line has exactly two columns, source then target.

Every document has a number that does not depend on how the input is split (``--part``): its index in its
file (for .parquet and .arrow: its row's) plus the file's index in the input (docs/data.md). The held-out
split is decided on it.

Null texts are dropped and counted, texts of other types refused; a document longer than MAX_DOCUMENT_CHARS
is skipped and counted (a .jsonl or .tsv line past four times that many bytes is not even read whole).
Damaged files (garbled, truncated, nested past the JSON parser's depth) stop the run in one line naming the
file.
"""

from __future__ import annotations

import codecs
import gzip
import io
import json
import zlib
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
    number: int = 0  # the file's index in the input + the document's (row's) index in its file


@dataclass(frozen=True)
class Piece:
    """Some of the input: a file, or row groups [first, stop) of a .parquet file (``row_groups``)."""

    path: str
    index: int  # the file's index in the whole input
    row_groups: tuple[int, int] | None = None


MAX_DOCUMENT_CHARS = 1 << 26  # a longer document (64 Mi characters, ~16M tokens) is skipped, with a count


@dataclass
class DecodeStats:
    """What reading the input changed or left out: lines whose bad bytes were replaced, records whose text is
    null (dropped), documents longer than MAX_DOCUMENT_CHARS (skipped; the first one's place)."""

    replaced_lines: int = 0
    null_texts: int = 0
    too_long: int = 0
    first_too_long: str = ""
    no_tokens: int = 0  # texts the tokenizer made no token of (counted by the shard writer)

    def skip_long(self, where: str) -> None:
        self.too_long += 1
        self.first_too_long = self.first_too_long or where

    def notes(self) -> list[str]:
        """A line for each kind of record changed or left out, for the end of a run."""
        lines = []
        if self.replaced_lines:
            lines.append(
                f"warning: {self.replaced_lines:,} input lines were not valid UTF-8; their bad bytes were replaced "
                "(--on-decode-error fail stops at the first one instead)"
            )
        if self.too_long:
            lines.append(
                f"warning: {self.too_long:,} documents longer than {MAX_DOCUMENT_CHARS:,} characters were skipped "
                f"(the first: {self.first_too_long}); split them into documents of their own to keep them"
            )
        if self.null_texts:
            lines.append(f"note: {self.null_texts:,} records whose text is null were dropped")
        if self.no_tokens:
            lines.append(f"note: {self.no_tokens:,} texts of no token (all normalized away) were dropped")
        return lines


_COMPRESSED: dict[str, IO[bytes]] = {}  # the compressed file under each .gz / .zst being read, by path


def compressed_offset(path: str) -> int | None:
    """How many compressed bytes of ``path`` (a .gz or .zst file being read in this process) have been read so
    far, for a progress bar; None when it is not being read."""
    raw = _COMPRESSED.get(str(Path(path)))
    try:
        return None if raw is None else raw.tell()
    except (OSError, ValueError):  # (closed meanwhile)
        return None


def _open_binary(path: Path) -> IO[bytes]:
    if path.suffix == ".gz":
        stream = gzip.open(path, "rb")
        _COMPRESSED[str(path)] = stream.fileobj
        return stream
    if path.suffix == ".zst":
        import zstandard

        raw = _COMPRESSED[str(path)] = open(path, "rb")
        return zstandard.ZstdDecompressor().stream_reader(raw)
    return open(path, "rb")


def _lines(path: Path, on_decode_error: str, stats: DecodeStats) -> Iterator[tuple[int, str | None]]:
    """(number, text) of the file's lines; None for a line longer than 4 x MAX_DOCUMENT_CHARS bytes (read no
    further than that, counted as a document too long)."""
    damage: tuple[type[BaseException], ...] = (EOFError, OSError, zlib.error)
    if path.suffix == ".zst":  # (zstandard only where a file needs it)
        import zstandard

        damage += (zstandard.ZstdError,)
    decoder = codecs.getincrementaldecoder("utf-8")("strict")
    limit = 4 * MAX_DOCUMENT_CHARS
    number = 0
    try:
        with _open_binary(path) as raw:
            reader = io.BufferedReader(raw)
            while line := reader.readline(limit + 1):
                number += 1
                if len(line) > limit and not line.endswith(b"\n"):
                    while (rest := reader.readline(1 << 20)) and not rest.endswith(b"\n"):
                        pass
                    stats.skip_long(f"{path}:{number}")
                    yield number, None
                    continue
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
    except damage as err:
        damaged = f"a truncated or damaged {path.suffix} file, " if path.suffix in (".gz", ".zst") else ""
        raise DataError(
            f"{path}: unreadable after line {number} ({damaged}{type(err).__name__}: {err}); fix or re-download it"
        ) from None
    finally:
        _COMPRESSED.pop(str(path), None)


COLUMNAR = (".parquet", ".arrow")  # read by pyarrow; never .gz / .zst (compressed inside)
INPUT_SUFFIXES = (".txt", ".jsonl", ".json", ".tsv")  # plain, .gz or .zst


def _kind(path: Path) -> str:
    if path.name.endswith(COLUMNAR):
        return path.suffix.removeprefix(".")
    name = path.name.removesuffix(".gz").removesuffix(".zst")
    if name.endswith(".jsonl") or name.endswith(".json"):
        return "jsonl"
    if name.endswith(".tsv"):
        return "tsv"
    return "txt"


def _is_input(path: Path) -> bool:
    return path.is_file() and (
        path.name.endswith(COLUMNAR) or path.name.removesuffix(".gz").removesuffix(".zst").endswith(INPUT_SUFFIXES)
    )


def input_files(names: list[str]) -> list[str]:
    """``--input`` as files: a directory stands for its files of the kinds read here (.txt, .jsonl, .json,
    .tsv, plain or .gz / .zst; .parquet, .arrow), in name order, and a ``datasets`` directory written by
    ``save_to_disk`` for its .arrow files; a file is kept as given."""
    files: list[str] = []
    for name in names:
        path = Path(name)
        if not path.is_dir():
            files.append(name)
        elif (path / "state.json").is_file() and (path / "dataset_info.json").is_file():
            files += _saved_dataset_files(path)
        elif (path / "dataset_dict.json").is_file():
            splits = sorted(p.name for p in path.iterdir() if (p / "state.json").is_file())
            raise DataError(
                f"input directory {path} is a datasets DatasetDict (splits: {', '.join(splits)}); give one "
                f"split's directory, e.g. {path / (splits[0] if splits else 'train')}"
            )
        else:
            found = sorted(str(p) for p in path.iterdir() if _is_input(p))
            if not found:
                raise DataError(
                    f"input directory {path} holds no .txt, .jsonl, .json or .tsv files (plain, .gz or .zst), "
                    ".parquet or .arrow files"
                )
            files += found
    return files


def files_not_read(names: list[str]) -> list[str]:
    """The files of ``--input`` directories that :func:`input_files` leaves out (not of a kind read here), in
    name order; a ``datasets`` directory's own files are read through its state, not left out."""
    return [
        str(p)
        for name in names
        if Path(name).is_dir() and not (Path(name) / "state.json").is_file()
        for p in sorted(Path(name).iterdir())
        if p.is_file() and not _is_input(p)
    ]


def _saved_dataset_files(directory: Path) -> list[str]:
    """The .arrow files of a ``datasets.Dataset.save_to_disk`` directory, in the dataset's row order: files of
    the directory itself, never a path or a link out of it."""
    state = directory / "state.json"
    try:
        names = [entry["filename"] for entry in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{state} is not a datasets state file ({type(err).__name__}: {err})") from None
    root = directory.resolve()
    for name in names:
        inside = isinstance(name, str) and Path(name).name == name and name not in ("", ".", "..")
        if not inside or (directory / name).resolve().parent != root:
            raise DataError(
                f"{state} names {name!r}, which is not a file inside {directory} (a path or a link out of it); "
                "give the directory `Dataset.save_to_disk` wrote"
            )
    return [str(directory / name) for name in names]


class Reading:
    """How far into the inputs the reading is, in bytes, for a progress bar (data shard's, data tokenizer's):
    finished files whole, the one being read by the text taken from it (a .gz / .zst one by its compressed bytes
    read; a part of a .parquet file when finished)."""

    def __init__(self, files: list[str | Piece]) -> None:
        self.sizes: dict[str, int] = {}
        for f in files:
            path = f.path if isinstance(f, Piece) else str(f)
            self.sizes[path] = Path(path).stat().st_size if Path(path).is_file() else 0
        self.total = sum(self.sizes.values())
        self.finished, self.file, self.text = 0, None, 0

    def add(self, doc: Document) -> None:
        if doc.file != self.file:
            self.finished += self.sizes.get(self.file, 0)
            self.file, self.text = doc.file, 0
        self.text += len(doc.text) + (len(doc.prompt) if doc.prompt else 0)

    @property
    def position(self) -> int:
        size = self.sizes.get(self.file, 0)
        if Path(self.file or "").suffix in INPUT_SUFFIXES:
            return self.finished + min(self.text, size)
        compressed = compressed_offset(self.file) if self.file else None  # (.gz, .zst: the bytes read of the file)
        return self.finished + (min(compressed, size) if compressed is not None else 0)


def read_documents(
    files: list[str | Path | Piece],
    text_field: str = "text",
    doc_per: str = "block",
    on_decode_error: str = "replace",
    stats: DecodeStats | None = None,
    prompt_field: str | None = None,
) -> Iterator[Document]:
    """Yield documents from the files (or the ``Piece`` s of the input) in order; empty documents are dropped.
    With ``prompt_field``, yield instruction examples (``.jsonl``, ``.tsv``, ``.parquet`` or ``.arrow``)."""
    stats = stats or DecodeStats()
    for position, entry in enumerate(files):
        piece = entry if isinstance(entry, Piece) else Piece(str(entry), position)
        path = Path(piece.path)
        if not path.is_file():
            raise DataError(f"input file {path} does not exist")
        kind = _kind(path)
        if kind in ("parquet", "arrow"):
            batches = _record_batches(path, kind, [text_field, prompt_field], piece.row_groups)
            docs = _table_documents(path, batches, text_field, prompt_field, stats)
        else:
            docs = enumerate(_text_documents(path, kind, text_field, doc_per, on_decode_error, stats, prompt_field))
        for number, doc in docs:
            doc.number = piece.index + number
            yield doc


def _text_documents(
    path: Path,
    kind: str,
    text_field: str,
    doc_per: str,
    on_decode_error: str,
    stats: DecodeStats,
    prompt_field: str | None,
) -> Iterator[Document]:
    lines = _lines(path, on_decode_error, stats)
    if prompt_field is not None:
        if kind == "tsv":
            yield from _tsv_examples(path, lines, prompt_field, text_field, stats)
            return
        if kind != "jsonl":
            raise DataError(
                f"{path}: prompt/completion (source/target) examples are read from .jsonl, .tsv, .parquet and "
                ".arrow files only"
            )
        yield from _instruction_examples(path, lines, prompt_field, text_field, stats)
    elif kind == "jsonl":
        yield from _jsonl_documents(path, lines, text_field, stats)
    elif doc_per == "file":
        yield from _file_document(path, lines, stats)
    else:
        yield from _block_documents(path, lines, stats)


BATCH_ROWS = 1024  # rows per record batch read from .parquet / .arrow files


def _record_batches(path: Path, kind: str, fields: list[str | None], row_groups: tuple[int, int] | None):
    """(index of the first row, record batch) of the columns ``fields`` of a .parquet file (of its
    ``row_groups``, or all) or a .arrow file (Arrow IPC, the stream format of ``datasets``, or the file format),
    a record batch at a time."""
    import pyarrow as pa

    columns = [f for f in fields if f is not None]
    try:
        if kind == "parquet":
            import pyarrow.parquet as pq

            parquet = pq.ParquetFile(path)
            _check_columns(path, parquet.schema_arrow, columns)
            first, stop = row_groups or (0, parquet.num_row_groups)
            row = sum(parquet.metadata.row_group(i).num_rows for i in range(first))
            for batch in parquet.iter_batches(BATCH_ROWS, row_groups=list(range(first, stop)), columns=columns):
                batch.validate(full=True)
                yield row, batch
                row += len(batch)
            return
        source = pa.memory_map(str(path))
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            reader = pa.ipc.open_file(source)
            _check_columns(path, reader.schema, columns)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            _check_columns(path, reader.schema, columns)
            batches = reader
        row = 0
        for batch in batches:
            batch = batch.select(columns)
            batch.validate(full=True)  # (an IPC file's offsets and UTF-8 are trusted until validated)
            yield row, batch
            row += len(batch)
    except (pa.ArrowException, OSError) as err:
        at = f"; at row {row + 1}" if "row" in locals() else ""
        raise DataError(f"{path}: not a readable .{kind} file ({type(err).__name__}: {err}{at})") from None


def _check_columns(path: Path, schema, columns: list[str]) -> None:
    import pyarrow as pa

    for name in columns:
        if name not in schema.names:
            raise DataError(
                f"{path}: no column {name!r} (it has {', '.join(schema.names)}); choose one with --text-field "
                "(or --prompt-field / --completion-field)"
            )
        column = schema.field(name).type
        values = column.value_type if pa.types.is_dictionary(column) else column  # (dictionary-encoded strings)
        if not (pa.types.is_string(values) or pa.types.is_large_string(values) or pa.types.is_string_view(values)):
            raise DataError(f"{path}: column {name!r} holds {column}, not text; choose a text column")


def _table_documents(
    path: Path, batches, text_field: str, prompt_field: str | None, stats: DecodeStats
) -> Iterator[tuple[int, Document]]:
    """(row index, document) of the rows with text."""
    for first, batch in batches:
        texts = batch.column(text_field).to_pylist()
        prompts = batch.column(prompt_field).to_pylist() if prompt_field is not None else [None] * len(texts)
        for row, (text, prompt) in enumerate(zip(texts, prompts), start=first):
            if text is None and (prompt_field is None or prompt is None):
                stats.null_texts += 1
            elif len(text or "") + len(prompt or "") > MAX_DOCUMENT_CHARS:
                stats.skip_long(f"{path} row {row + 1}")
            elif prompt_field is None:
                text = text.strip()
                if text:
                    yield row, Document(text, str(path), row + 1)
            elif text or prompt:
                yield row, Document(text or "", str(path), row + 1, prompt=prompt or "")


def _file_document(path: Path, lines, stats: DecodeStats) -> Iterator[Document]:
    text, chars = [], 0
    for _, line in lines:
        if line is None or chars + len(line) > MAX_DOCUMENT_CHARS:
            stats.skip_long(str(path))
            return
        text.append(line)
        chars += len(line)
    if joined := "".join(text).strip():
        yield Document(joined, str(path), 1)


def _block_documents(path: Path, lines, stats: DecodeStats) -> Iterator[Document]:
    block: list[str] = []
    start, chars, too_long = 1, 0, False  # too_long: the block is skipped
    for number, line in lines:
        if line is None or line.strip():
            if not block and not too_long:
                start = number
            if line is None or chars + len(line) > MAX_DOCUMENT_CHARS:
                if not too_long:
                    stats.skip_long(f"{path}:{start}")
                block, chars, too_long = [], 0, True
            else:
                block.append(line.rstrip("\n"))
                chars += len(line)
        elif block or too_long:
            if block:
                yield Document("\n".join(block), str(path), start)
            block, chars, too_long = [], 0, False
    if block:
        yield Document("\n".join(block), str(path), start)


def _records(path: Path, lines) -> Iterator[tuple[int, dict]]:
    """(line number, JSON object) of the lines that are not blank (nor too long: counted where read)."""
    for number, line in lines:
        if line is None or not line.strip():
            continue
        try:
            record = json.loads(line)
        except RecursionError:
            raise DataError(f"{path}:{number}: JSON nested too deeply to read; fix the record") from None
        except ValueError as err:
            reason = err.msg if isinstance(err, json.JSONDecodeError) else str(err)
            raise DataError(f"{path}:{number}: invalid JSON ({reason})") from None
        if not isinstance(record, dict):
            raise DataError(f"{path}:{number}: expected a JSON object, got {type(record).__name__}")
        yield number, record


def _jsonl_documents(path: Path, lines, text_field: str, stats: DecodeStats) -> Iterator[Document]:
    for number, record in _records(path, lines):
        if text_field not in record:
            raise DataError(f"{path}:{number}: no {text_field!r} field; choose one with --text-field")
        text = record[text_field]
        if text is None:
            stats.null_texts += 1
            continue
        if not isinstance(text, str):
            raise DataError(
                f"{path}:{number}: the field {text_field!r} holds a {type(text).__name__}, not a string; fix the "
                "record or choose another field with --text-field"
            )
        if len(text) > MAX_DOCUMENT_CHARS:
            stats.skip_long(f"{path}:{number}")
        elif text := text.strip():
            yield Document(text, str(path), number)


def _instruction_examples(
    path: Path, lines, prompt_field: str, completion_field: str, stats: DecodeStats
) -> Iterator[Document]:
    for number, record in _records(path, lines):
        for name, option in ((prompt_field, "--prompt-field"), (completion_field, "--completion-field")):
            if not isinstance(record.get(name), str):
                raise DataError(f"{path}:{number}: no string field {name!r}; choose the field with {option}")
        if len(record[prompt_field]) + len(record[completion_field]) > MAX_DOCUMENT_CHARS:
            stats.skip_long(f"{path}:{number}")
        elif record[prompt_field] or record[completion_field]:
            yield Document(record[completion_field], str(path), number, prompt=record[prompt_field])


def _tsv_examples(path: Path, lines, source_field: str, target_field: str, stats: DecodeStats) -> Iterator[Document]:
    """Pairs from a .tsv file (see the module docstring for the header rule)."""
    columns, width = (0, 1), 2
    for number, line in lines:
        if line is None:
            continue
        if len(line) > MAX_DOCUMENT_CHARS:
            stats.skip_long(f"{path}:{number}")
            continue
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
