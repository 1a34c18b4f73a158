"""A split's datasets as shard sets, resolved from the data settings and checked against the tokenizer,
the objective and the streams before anything is read."""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_pipeline import DataError
from data_pipeline.remote import Retry, check_location, is_remote, join
from data_pipeline.settings import Dataset, Datasets
from data_pipeline.shard import INSTRUCTIONS, Manifest, ShardInfo
from data_pipeline.tokenizer import TokenizerInfo


@dataclass
class ShardSet:
    """One dataset's shards of one split, as its manifest lists them, with the dataset's mixing weight."""

    directory: str  # local path or URL
    split: str
    shards: list[ShardInfo]
    weight: float
    manifest: Manifest

    @property
    def fingerprint(self) -> str:
        """Identifies the shards' content (not their location), for resume checks."""
        return hashlib.sha256("".join(s.sha256 for s in self.shards).encode()).hexdigest()[:16]

    @property
    def remote(self) -> bool:
        return is_remote(self.directory)

    def location(self, info: ShardInfo) -> str:
        return join(self.directory, info.file)

    def check_contained(self) -> None:
        """A local dataset's shards are its own files: neither a shard nor a (part) folder holding shards may be a
        link out of the directory (a manifest names only its own shards)."""
        root = Path(self.directory).resolve()
        links: dict[str, set[str]] = {}  # folder -> the names of its links
        for info in self.shards:
            folder, _, name = info.file.rpartition("/")
            if folder not in links:
                real = Path(self.directory, folder).resolve()
                if real != root / folder:
                    raise DataError(
                        f"{self.directory}: its folder {folder} is a link to {real}; a dataset's shards are its own "
                        "files (copy them in, or re-shard)"
                    )
                links[folder] = {e.name for e in os.scandir(real) if e.is_symlink()} if real.is_dir() else set()
            if name in links[folder]:
                target = Path(self.directory, info.file).resolve()
                raise DataError(
                    f"{self.directory}: its shard {info.file} is a link to {target}; a dataset's shards are its own "
                    "files (copy them in, or re-shard)"
                )

    def missing(self) -> list[str]:
        """The listed shards that are not in the (local) directory (or its part directories): a listing per
        directory, not a stat per shard."""
        listings: dict[str, set[str]] = {}

        def listing(folder: str) -> set[str]:
            if folder not in listings:
                path = Path(self.directory, folder)
                listings[folder] = {e.name for e in os.scandir(path) if e.is_file()} if path.is_dir() else set()
            return listings[folder]

        return [
            self.location(info)
            for info in self.shards
            if info.file.rpartition("/")[2] not in listing(info.file.rpartition("/")[0])
        ]


def resolve_datasets(datasets: Datasets, split: str, retry: Retry, fallback: Datasets = None) -> list[ShardSet]:
    """``train`` / ``valid`` (a directory or URL, or a list of Datasets) as the ShardSets of one split."""
    datasets = datasets if datasets is not None else fallback
    if datasets is None:
        raise DataError(f"data.{split} is not set; point it at a directory written by `megatransformer data shard`")
    entries = [Dataset(str(datasets))] if isinstance(datasets, (str, Path)) else datasets
    shard_sets = []
    for entry in entries:
        check_location(entry.path)
        manifest = Manifest.load(entry.path, retry)
        shards = manifest.splits.get(split, [])
        if not shards:
            hint = "; set data.valid or re-shard with --valid-every N" if split == "valid" else ""
            raise DataError(f"{entry.path} has no {split} shards (its manifest lists {sorted(manifest.splits)}){hint}")
        shard_set = ShardSet(str(entry.path), split, shards, entry.weight, manifest)
        if not shard_set.remote:
            shard_set.check_contained()
        shard_sets.append(shard_set)
    return shard_sets


def check_compatible(shard_sets: list[ShardSet], tok: TokenizerInfo, vocab_size: int) -> None:
    """Shards, tokenizer and model must agree on the token ids; checked before any step is taken."""
    for shard_set in shard_sets:
        m = shard_set.manifest
        if m.tokenizer_sha256 != tok.sha256:
            raise DataError(
                f"{shard_set.directory} was tokenized with another tokenizer than data.tokenizer="
                f"{tok.path} (sha256 {m.tokenizer_sha256[:12]} vs {tok.sha256[:12]}); re-shard it"
            )
        if m.vocab_size != tok.vocab_size or np.iinfo(m.dtype).max < m.vocab_size - 1:
            raise DataError(
                f"{shard_set.directory}: manifest says vocab {m.vocab_size} in {m.dtype}, the tokenizer "
                f"has {tok.vocab_size} tokens; re-shard it"
            )
        if m.vocab_size > vocab_size:
            raise DataError(
                f"{shard_set.directory} holds token ids up to {m.vocab_size - 1} but "
                f"model.vocab_size={vocab_size}; set model.vocab_size >= {m.vocab_size}"
            )
    if tok.vocab_size > vocab_size:
        raise DataError(
            f"tokenizer {tok.path} has {tok.vocab_size} tokens but model.vocab_size={vocab_size}; "
            f"set model.vocab_size >= {tok.vocab_size}"
        )


def check_instructions(shard_sets: list[ShardSet], objective: str) -> None:
    """Instruction (prompt, completion) shards need an objective that can leave the prompt unscored."""
    instructions = [s for s in shard_sets if s.manifest.kind == INSTRUCTIONS]
    if not instructions:
        return
    where = instructions[0].directory
    if objective not in ("autoregressive", "prefix_lm"):
        raise DataError(
            f"{where} holds prompt/completion examples, which objective={objective} cannot use; "
            "train them with objective=autoregressive or objective=prefix_lm"
        )


def check_streams(shard_sets: list[ShardSet], streams: int, dp_size: int, workers: int) -> None:
    """Every reader serves a whole number of streams, and every stream gets documents in every epoch."""
    readers = dp_size * max(1, workers)
    if streams % readers:
        fits = [w for w in range(max(1, workers), 0, -1) if streams % (dp_size * w) == 0]
        hint = f"data.num_workers={fits[0]}" if fits else "a data-parallel size that divides it"
        raise DataError(
            f"data.streams={streams} cannot be dealt to {dp_size} ranks x {max(1, workers)} workers = "
            f"{readers} readers (each reader serves a whole number of streams); set data.streams to a "
            f"multiple of {readers} when the run starts, or use {hint}"
        )
    for shard_set in shard_sets:
        n = len(shard_set.shards)
        fewest = min(s.documents for s in shard_set.shards)
        if n < streams and fewest < math.ceil(streams / n):
            raise DataError(
                f"{shard_set.directory}: {n} {shard_set.split} shard(s) with as few as {fewest} documents "
                f"cannot feed data.streams={streams} (each stream needs a document per epoch); lower "
                f"data.streams to {n * fewest} or less when the run starts"
            )
