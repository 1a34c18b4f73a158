"""Tokenizing one input as N parts (``data shard --part K/N``, e.g. a Slurm array) and the record a finished
part leaves; ``data_pipeline.merge`` joins the parts into one dataset (docs/data.md).

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

PART_RECORD = "part.json"


def parse_part(text: str) -> tuple[int, int]:
    """``K/N`` with 1 <= K <= N."""
    k, sep, n = text.partition("/")
    if not (sep and k.isdigit() and n.isdigit() and 1 <= int(k) <= int(n)):
        raise ValueError(f"{text!r} is not K/N with 1 <= K <= N, e.g. 3/8")
    return int(k), int(n)


def part_name(part: tuple[int, int]) -> str:
    return f"part-{part[0]:05d}-of-{part[1]:05d}"


def part_files(files: list[str], part: tuple[int, int]) -> tuple[int, list[str]]:
    """Part K of N (from 1) of the input: the K-th of N runs of consecutive whole files, as even in count as
    can be; with the index of its first file in the input."""
    k, n = part
    if n > len(files):
        raise DataError(
            f"--part {k}/{n}: the input has {len(files)} files and a part is a run of whole files; "
            f"split it into at most {len(files)} parts"
        )
    first, stop = (k - 1) * len(files) // n, k * len(files) // n
    return first, files[first:stop]


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
