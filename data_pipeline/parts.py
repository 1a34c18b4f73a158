"""Tokenizing one input as N parts (``data shard --part K/N``, e.g. a Slurm array): the input's segments (the
runs of files that shards never span beyond, the same for every N), which of them a part reads (shared out by
the files' text, not their compressed bytes), and the record a finished part leaves; ``data_pipeline.merge``
joins the parts into one dataset (docs/data.md).

Layout, under the dataset directory ``--out``::

    part-00001-of-00004/train-000000.tar ...   the part's shards, as ``data shard`` writes them
    part-00001-of-00004/part.json              written last: the part's manifest, its shards' sizes, the
                                               input and the settings it was tokenized with
    manifest.json                              written by ``data merge`` once every part is finished
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from data_pipeline import DataError
from data_pipeline.documents import Piece

PART_RECORD = "part.json"


def parse_part(text: str) -> tuple[int, int]:
    """``K/N`` with 1 <= K <= N."""
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"{text!r} is not K/N with 1 <= K <= N, e.g. 3/8")
    return int(k), int(n)


def part_name(part: tuple[int, int]) -> str:
    return f"part-{part[0]:05d}-of-{part[1]:05d}"


@dataclass(frozen=True)
class Segment:
    """Consecutive pieces of the input that no shard spans beyond: every run, one part or N, starts a new shard
    at a segment's first document, so a shard's documents depend on the input alone, not on the parts."""

    pieces: tuple[Piece, ...]
    start: int  # bytes of the input's text before it (``text_sizes`` laid end to end)
    size: int  # bytes of text it holds


def segments(files: list[str], segment_bytes: int) -> list[Segment]:
    """The input cut into segments: consecutive files (a .parquet file as its row groups, each a unit of its
    own) taken together until they hold at least ``segment_bytes`` of text. A function of the files' names and
    text sizes alone, so every part computes the same segments."""
    units: list[tuple[str, int, int | None, int]] = []  # (file, index in the input, row group, text bytes)
    for index, (name, (size, starts)) in enumerate(zip(files, text_sizes(files))):
        if starts and len(starts) > 1:
            ends = [*starts[1:], size]
            units += [(name, index, group, end - start) for group, (start, end) in enumerate(zip(starts, ends))]
        else:
            units.append((name, index, None, size))
    found: list[Segment] = []
    group: list[tuple[str, int, int | None, int]] = []
    start = held = 0
    for unit in units:
        group.append(unit)
        held += unit[3]
        if held >= segment_bytes:
            found.append(Segment(_pieces(group), start, held))
            start, group, held = start + held, [], 0
    if group:
        found.append(Segment(_pieces(group), start, held))
    return found


def _pieces(units: list[tuple[str, int, int | None, int]]) -> tuple[Piece, ...]:
    """Units as pieces: a file whole, the row groups of one .parquet file that follow each other as one piece."""
    pieces: list[Piece] = []
    for name, index, group, _ in units:
        last = pieces[-1] if pieces else None
        if group is None:
            pieces.append(Piece(name, index))
        elif last is not None and last.index == index:
            pieces[-1] = Piece(name, index, (last.row_groups[0], group + 1))
        else:
            pieces.append(Piece(name, index, (group, group + 1)))
    return tuple(pieces)


def part_segments(all_segments: list[Segment], part: tuple[int, int]) -> list[Segment]:
    """Part K of N (from 1): the segments whose first byte of text falls in the K-th of N equal ranges of the
    input's text, so a part holds within one segment of 1/N of the text. A part may be empty."""
    k, n = part
    total = sum(segment.size for segment in all_segments)
    return [s for s in all_segments if (min(n, s.start * n // total + 1) if total else 1) == k]


ZSTD_RATIO = 4  # text bytes per byte of a .zst file whose frame does not say its size (zstd's usual on text)


def text_sizes(files: list[str]) -> list[tuple[int, list[int] | None]]:
    """About how many bytes of text each file holds, so that parts share out the work, not the compressed bytes
    (a .gz file of repetitive text holds 20x its size): a .gz file's size as its trailer says it (modulo 4 GiB:
    the smallest such size above the file's), a .zst file's as its first frame says it (else ZSTD_RATIO x its
    size), a .parquet file's as its row groups' uncompressed sizes (with where each starts in them), any other
    file's size on disk."""
    return [_text_size(name) for name in files]


def _text_size(name: str) -> tuple[int, list[int] | None]:
    size = Path(name).stat().st_size
    if name.endswith(".parquet"):
        return _row_group_starts(name)
    if name.endswith(".gz") and size >= 18:
        with open(name, "rb") as f:
            f.seek(-4, 2)
            text = int.from_bytes(f.read(4), "little")
        while text < size:
            text += 1 << 32
        return text, None
    if name.endswith(".zst"):
        import zstandard

        with open(name, "rb") as f:
            head = f.read(18)
        try:
            text = zstandard.frame_content_size(head)
        except zstandard.ZstdError:
            text = -1
        return (text if text >= 0 else ZSTD_RATIO * size), None
    return size, None


def _row_group_starts(name: str) -> tuple[int, list[int]]:
    """A .parquet file's uncompressed size and where each row group starts in it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(name).metadata
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{name}: not a readable .parquet file ({type(err).__name__}: {err})") from None
    starts, position = [], 0
    for i in range(metadata.num_row_groups):
        starts.append(position)
        position += metadata.row_group(i).total_byte_size
    return position, starts


def input_fingerprint(files: list[str]) -> dict:
    """What every part must agree on about the whole input: its files' names, sizes and sizes of text (parts
    that shared the input out by other sizes do not merge)."""
    listing = "".join(
        f"{name}\t{Path(name).stat().st_size}\t{text}\n" for name, (text, _) in zip(files, text_sizes(files))
    )
    return {"files": len(files), "sha256": hashlib.sha256(listing.encode()).hexdigest()}


def save_part(directory: Path, part: tuple[int, int], manifest: dict, inputs: dict, settings: dict) -> None:
    """The part's record, written last and atomically: from then on the part is finished."""
    shards = [s["file"] for split in manifest["splits"].values() for s in split]
    record = {
        "part": list(part),
        "inputs": inputs,
        "settings": settings,
        "shard_bytes": {name: (directory / name).stat().st_size for name in shards},
        "manifest": manifest,
    }
    tmp = directory / f".{PART_RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2))
    tmp.replace(directory / PART_RECORD)
