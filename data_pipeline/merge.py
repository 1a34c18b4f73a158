"""``data merge``: join the finished parts of a dataset directory (``data_pipeline.parts``) into one dataset.

The shards stay where their parts wrote them; the merged manifest lists them by their paths relative to the
dataset directory, part after part, so the documents come in the input's order, as one run would write them.
The manifest is treated generically: splits are concatenated, the counts in ``SUMMED`` added, and every other
field must be the same in every part.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, NonNegativeInt, PositiveInt, ValidationError, field_validator

from data_pipeline import DataError, schema_error
from data_pipeline.parts import PART_RECORD, part_name
from data_pipeline.shard import MANIFEST, Manifest

SUMMED = ("documents", "replaced_lines")  # manifest fields that count; the others describe the whole dataset
AGREED = ("inputs", "settings")  # part record fields every part must share


class PartRecord(BaseModel):
    """A finished part's ``part.json`` (written by ``data_pipeline.parts.save_part``); its manifest is checked
    as the merged one."""

    model_config = ConfigDict(extra="forbid", strict=True)

    part: tuple[PositiveInt, PositiveInt]
    inputs: dict[str, Any]
    settings: dict[str, Any]
    shard_bytes: dict[str, NonNegativeInt]
    manifest: dict[str, Any]

    @field_validator("part")
    @classmethod
    def _k_of_n(cls, part: tuple[int, int]) -> tuple[int, int]:
        if part[0] > part[1]:
            raise ValueError(f"part {part[0]} of {part[1]}: K > N")
        return part


def merge_parts(directory: str | Path, overwrite: bool = False) -> Manifest:
    """Write ``directory``'s manifest from its parts; DataError, before writing anything, when a part is
    missing, unfinished, truncated, listed twice, or made from other inputs, settings or tokenizer."""
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"{directory} is not a directory; give the --out of `megatransformer data shard --part`")
    parts = _finished_parts(directory)
    merged = _merged_manifest(directory, parts)
    path = directory / MANIFEST
    text = json.dumps(merged, indent=2)
    if path.exists() and not overwrite and path.read_text(errors="replace") != text:
        raise DataError(f"{path} already exists and differs from the merged parts; pass --overwrite to replace it")
    tmp = directory / f".{MANIFEST}.tmp"
    tmp.write_text(text)
    tmp.replace(path)
    try:
        return Manifest.load(directory)
    except DataError:
        path.unlink()
        raise


def _finished_parts(directory: Path) -> list[tuple[Path, dict]]:
    """The part directories with their records, in part order, after checking that they are all there."""
    found: dict[tuple[int, int], tuple[Path, dict]] = {}
    for path in sorted(p for p in directory.glob("part-*") if p.is_dir()):
        if path.is_symlink():
            raise DataError(
                f"{path} is a link (to {path.resolve()}); a part's shards live in its own directory: move them there"
            )
        record = _load_record(path)
        part = tuple(record["part"])
        if part in found:
            raise DataError(
                f"{found[part][0]} and {path} are both part {part[0]}/{part[1]}; remove the one that is not wanted"
            )
        if path.name != part_name(part):
            raise DataError(
                f"{path} holds the record of part {part[0]}/{part[1]}; move the directory back to "
                f"{directory / part_name(part)}, or re-run that part with --overwrite"
            )
        found[part] = (path, record)
    if not found:
        raise DataError(f"{directory} holds no finished parts (part-*/{PART_RECORD}); run `data shard --part K/N`")
    counts = sorted({n for _, n in found})
    if len(counts) > 1:
        a, b = (next(path for (_, n), (path, _) in found.items() if n == count) for count in counts[:2])
        raise DataError(
            f"{a} and {b} split the input into different numbers of parts ({counts[0]} and {counts[1]}); "
            "move the stale ones away"
        )
    n = counts[0]
    missing = [k for k in range(1, n + 1) if (k, n) not in found]
    if missing:
        raise DataError(
            f"part {missing[0]}/{n} is missing ({len(missing)} of {n} parts are): no "
            f"{directory / part_name((missing[0], n))}; run `data shard --part {missing[0]}/{n}` and merge again"
        )
    return [found[(k, n)] for k in range(1, n + 1)]


def _load_record(path: Path) -> dict:
    file = path / PART_RECORD
    if not file.is_file():
        raise DataError(
            f"{path} has no {PART_RECORD}: an unfinished part (interrupted or still running); run that "
            "`data shard --part` again with --overwrite, or move the directory away, and merge again"
        )
    try:
        record = PartRecord.model_validate_json(file.read_bytes()).model_dump()
        k, n = record["part"]
        listed = [s["file"] for split in record["manifest"]["splits"].values() for s in split]
    except ValidationError as err:
        raise DataError(f"{file} is not a valid part record ({schema_error(err)}); re-run that part") from None
    except (ValueError, TypeError, KeyError, AttributeError) as err:
        raise DataError(f"{file} is not a valid part record ({type(err).__name__}: {err}); re-run that part") from None
    sizes = record["shard_bytes"]
    if sorted(listed) != sorted(sizes) or any(not isinstance(name, str) or Path(name).name != name for name in listed):
        raise DataError(f"{file} does not list its shards as the files of its directory; re-run part {k}/{n}")
    for name, size in sizes.items():
        shard = path / name
        if shard.is_symlink():
            raise DataError(f"{shard} is a link (to {shard.resolve()}); the part is damaged: re-run part {k}/{n}")
        actual = shard.stat().st_size if shard.is_file() else None
        if actual != size:
            state = "is missing" if actual is None else f"has {actual:,} bytes, its part record says {size:,}"
            raise DataError(f"{shard} {state}: the part is damaged; re-run part {k}/{n} with --overwrite")
    return record


def _merged_manifest(directory: Path, parts: list[tuple[Path, dict]]) -> dict:
    first_path, first = parts[0]
    merged = {key: value for key, value in first["manifest"].items() if key != "splits"}
    merged.update({key: 0 for key in SUMMED if key in merged})
    splits: dict[str, list[dict]] = {}
    for path, record in parts:
        manifest = record["manifest"]
        for key in AGREED:
            if record.get(key) != first.get(key):
                raise DataError(
                    f"{first_path} and {path} were made with different {key}: {first.get(key)} vs {record.get(key)}"
                )
        for key in set(manifest) | set(merged):
            if key in SUMMED:
                merged[key] += manifest.get(key, 0)
            elif key != "splits" and manifest.get(key) != merged.get(key):
                raise DataError(
                    f"{first_path} and {path} differ in {key} ({merged.get(key)} vs {manifest.get(key)}): "
                    "made with another tokenizer, format or --compress; re-make the parts alike"
                )
        for split, shards in manifest["splits"].items():
            splits.setdefault(split, []).extend({**s, "file": f"{path.name}/{s['file']}"} for s in shards)
    if not splits:
        raise DataError(f"no part in {directory} holds a document (empty inputs?)")
    merged["splits"] = splits
    return merged
