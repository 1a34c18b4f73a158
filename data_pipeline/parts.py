"""Tokenizing one input as N parts (``data shard --part K/N``, e.g. a Slurm array): which pieces of the input
a part reads, and the record a finished part leaves; ``data_pipeline.merge`` joins the parts into one dataset
(docs/data.md).

Layout, under the dataset directory ``--out``::

    part-00001-of-00004/train-000000.tar ...   the part's shards, as ``data shard`` writes them
    part-00001-of-00004/part.json              written last: the part's manifest, its shards' sizes, the
                                               input and the settings it was tokenized with
    manifest.json                              written by ``data merge`` once every part is finished
"""

from __future__ import annotations

import hashlib
import json
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


def part_pieces(files: list[str], part: tuple[int, int]) -> list[Piece]:
    """Part K of N (from 1) of the input: the K-th of N equal byte ranges of the files laid end to end. A file
    belongs to the part its first byte falls in, except a .parquet file that spans parts: its row groups are
    shared out by where each starts. Only such files' footers are read. A part may be empty."""
    k, n = part
    sizes = [Path(name).stat().st_size for name in files]
    total = sum(sizes)

    def owner(position: int) -> int:
        return min(n, position * n // total + 1) if total else 1

    pieces, start = [], 0
    for index, (name, size) in enumerate(zip(files, sizes)):
        first, last = owner(start), owner(start + max(size, 1) - 1)
        if first == last or not name.endswith(".parquet"):
            if first == k:
                pieces.append(Piece(name, index))
        elif first <= k <= last:
            owners = [owner(start + offset) for offset in _row_group_offsets(name)]
            mine = [i for i, o in enumerate(owners) if o == k]
            if mine:
                pieces.append(Piece(name, index, (mine[0], mine[-1] + 1)))
        start += size
    return pieces


def _row_group_offsets(name: str) -> list[int]:
    """Where each row group of a .parquet file starts, in bytes from the file's start."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        metadata = pq.ParquetFile(name).metadata
    except (pa.ArrowException, OSError) as err:
        raise DataError(f"{name}: not a readable .parquet file ({type(err).__name__}: {err})") from None
    offsets = []
    for i in range(metadata.num_row_groups):
        column = metadata.row_group(i).column(0)
        offsets.append(column.dictionary_page_offset if column.has_dictionary_page else column.data_page_offset)
    return offsets


def input_fingerprint(files: list[str]) -> dict:
    """What every part must agree on about the whole input: its files' names and sizes."""
    listing = "".join(f"{name}\t{Path(name).stat().st_size}\n" for name in files)
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
