"""The streaming loader: shards -> documents -> windows -> objective samples -> rows -> batches; the order of
the rows does not depend on how many ranks and workers read them, and it resumes exactly on any of them.

Streams, the global row order, exact and elastic resume, skipped rows, memory, instruction data, remote
shards: docs/data.md.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import os
import tarfile
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline import DataError
from data_pipeline.objectives import Objective, Window, build_objective
from data_pipeline.remote import Retry, ShardStream, check_location, is_remote, join
from data_pipeline.settings import Dataset, Datasets, DataSettings, ObjectiveArgs
from data_pipeline.shard import INSTRUCTIONS, Block, Expected, Manifest, ShardInfo
from data_pipeline.tokenizer import TokenizerInfo

SPLIT_SALT = {"train": 0, "valid": 1}
STATE_FORMAT = 2  # format 1 (before streams): per-reader positions, resumable on the same layout only
MAX_EMPTY_EPOCHS = 100  # epochs in a row in which a stream's shares were all corrupt: then it fails
RUN_TOKENS = 1 << 16  # documents are served in runs of whole shuffle blocks of at least this many tokens


@dataclass(frozen=True)
class LoaderSettings:
    """Everything the loader needs to know: the data settings (a run config's ``data`` section) and the run's
    choices they are read with (megatransformer.training.data passes a run config's)."""

    data: DataSettings  # which shards, and how they become rows
    objective: str  # autoregressive | masked_lm | prefix_lm | span_corruption
    arch: str  # decoder | encoder | encoder_decoder
    vocab_size: int  # the model's; shards must fit it
    seed: int = 0
    objective_args: ObjectiveArgs = field(default_factory=ObjectiveArgs)
    retry_wait: float = 1.0  # remote reads: seconds before the first retry (doubled each time)
    pin_memory: bool = False  # batches in page-locked memory (a CUDA run copies them without waiting)


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


# ------------------------------------------------------------------------------------------- shards


@dataclass
class Position:
    epoch: int = 0
    shard: int = 0  # index into this stream's shard list of the epoch
    doc: int = 0  # index into the (block-permuted) documents of that shard (part)
    offset: int = 0  # tokens of that document already consumed

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "doc": self.doc, "offset": self.offset}


@dataclass(frozen=True)
class Share:
    """What one stream reads of one shard: documents [first, stop) (the whole shard unless split)."""

    shard: int  # index into ShardSet.shards
    first: int
    stop: int


_VERIFIED: set[tuple] = set()  # (path, size, mtime, its manifest's sha256 and counts) checked in this process


@dataclass
class ShardOpener:
    """Opens shards after (local) or while (remote) checking them against the manifest; a corrupt or
    unreachable one raises or, with on_corrupt=skip, is warned about, remembered (in the loader state) and
    skipped."""

    on_corrupt: str
    retry: Retry
    skipped: list[str] = field(default_factory=list)

    def blocks(self, shard_set: ShardSet, share: Share) -> Iterator[tuple[int, Block]]:
        """(index of its first document in the shard, block) of the blocks holding documents of ``share``, in
        shard order; nothing if the shard is (found) corrupt and skipped."""
        info = shard_set.shards[share.shard]
        where = shard_set.location(info)
        if where in self.skipped:
            return
        try:
            if shard_set.remote:
                stream = ShardStream(where, info.sha256, self.retry)
                try:
                    yield from _tar_blocks(stream, shard_set.manifest, info, share)
                    stream.verify_rest()
                finally:
                    stream.close()
            else:
                verify_shard(Path(where), shard_set.manifest, info)
                with open(where, "rb") as f:
                    yield from _tar_blocks(f, shard_set.manifest, info, share)
        except (OSError, DataError, tarfile.TarError) as err:
            message = (
                f"missing shard {where} (listed in the manifest)"
                if isinstance(err, FileNotFoundError)
                else f"corrupt shard {where}: {err}"
            )
            if self.on_corrupt == "error":
                raise DataError(message + " (set data.on_corrupt=skip to skip it)") from None
            warnings.warn(message + "; skipping it (data.on_corrupt=skip)", stacklevel=2)
            self.skipped.append(where)


def verify_shard(path: Path, manifest: Manifest, info: ShardInfo) -> None:
    """Size-and-checksum check against the manifest, then its samples, documents and tokens counted (from the
    offsets alone, the ids passed over) against the manifest's: before any of its documents is served (once
    per file version and process)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns, info.sha256, info.samples, info.documents, info.tokens)
    if key in _VERIFIED:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != info.sha256:
        raise DataError("its sha256 differs from the manifest's (truncated or modified after writing)")
    with tarfile.open(path, mode="r:") as tar:  # (random access: the members not read are seeked over)
        _check_counts_of(_counts(tar, manifest, info), info)
    _VERIFIED.add(key)


def _counts(tar: tarfile.TarFile, manifest: Manifest, info: ShardInfo) -> tuple[int, int, int]:
    """(samples, documents, tokens) of a shard, its ids left unread (format 2)."""
    samples = documents = tokens = 0
    wanted = ("offsets.npy", "offsets.npy.zst") if manifest.version > 1 else ("ids.npy",)
    for sample in _tar_samples(tar, lambda: _expected(manifest, info, tokens, documents), wanted):
        n, t = Block.counts(sample, _expected(manifest, info, tokens, documents))
        samples, documents, tokens = samples + 1, documents + n, tokens + t
        _check_counts_of((samples, documents, tokens), info, partial=True)
    return samples, documents, tokens


def _expected(manifest: Manifest, info: ShardInfo, tokens: int, documents: int) -> Expected:
    """What the rest of a shard may hold once ``tokens`` of its tokens and ``documents`` of its documents are
    read."""
    rest_tokens, rest_documents = max(info.tokens - tokens, 0), max(info.documents - documents, 0)
    return Expected(rest_tokens, rest_documents, manifest.dtype, manifest.vocab_size, manifest.kind)


def _check_counts_of(counted: tuple[int, int, int], info: ShardInfo, partial: bool = False) -> None:
    """DataError if the (samples, documents, tokens) read of a shard are not (``partial``: exceed) its
    manifest's."""
    listed = (info.samples, info.documents, info.tokens)
    if any(c > n for c, n in zip(counted, listed)) or (not partial and counted != listed):
        samples, documents, tokens = counted
        so_far = "at least " if partial else ""
        raise DataError(
            f"it holds {so_far}{samples} samples of {documents} documents ({tokens:,} tokens), its "
            f"manifest says {info.samples} of {info.documents} ({info.tokens:,} tokens); re-create the directory "
            "with `megatransformer data shard`"
        )


SAMPLE_MEMBERS = tuple(f"{name}{zst}" for name in Block.MEMBERS for zst in ("", ".zst"))


def _tar_blocks(fileobj: BinaryIO, manifest: Manifest, info: ShardInfo, share: Share) -> Iterator[tuple[int, Block]]:
    """(index of its first document, block) of the samples of a shard that hold documents [share.first,
    share.stop), read as a stream and checked against the manifest as they are; the samples after the share
    are left unread (remote: the caller checks the sha256)."""
    samples = documents = tokens = 0
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for sample in _tar_samples(tar, lambda: _expected(manifest, info, tokens, documents)):
            expected = _expected(manifest, info, tokens, documents)
            if documents < share.first:  # before the share: only counted (compressed ids stay compressed)
                count, in_ids = Block.counts(sample, expected)
                if documents + count <= share.first:
                    samples, documents, tokens = samples + 1, documents + count, tokens + in_ids
                    _check_counts_of((samples, documents, tokens), info, partial=True)
                    continue
            block = Block.from_sample(sample, expected)
            samples, documents, tokens = samples + 1, documents + len(block), tokens + len(block.ids)
            _check_counts_of((samples, documents, tokens), info, partial=True)
            yield documents - len(block), block
            if documents >= share.stop and share.stop < info.documents:
                return
    _check_counts_of((samples, documents, tokens), info)


def _tar_samples(
    tar: tarfile.TarFile, expected: Callable[[], Expected], wanted: tuple[str, ...] = SAMPLE_MEMBERS
) -> Iterator[dict[str, bytes]]:
    """The samples of a tar written by ShardWriter (a sample's files are consecutive members ``<key>.<ext>``)
    as {ext: bytes}: the members ``wanted`` (others are passed over), each read only if its size is within
    what ``expected()`` (the rest of the shard) allows it."""
    key, sample = None, {}
    for member in tar:
        name, _, ext = member.name.rpartition("/")[2].partition(".")
        if name != key and key is not None:
            yield sample
            sample = {}
        key = name
        if member.isfile() and ext in wanted:
            limit = expected().member_bytes(ext.removesuffix(".zst"))
            if member.size > limit + (limit >> 7) + 1024:  # (zstd adds a little to what it cannot compress)
                raise DataError(f"a sample's {ext} holds {member.size:,} bytes, more than its shard's rest holds")
            sample[ext] = tar.extractfile(member).read()
    if key is not None:
        yield sample


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k & 0xFFFFFFFF for k in key])


@dataclass
class Run:
    """Consecutive documents of one share in the order they are served (after the shuffle): document k is
    ``tokens[bounds[k] : bounds[k + 1]]`` (EOS appended if asked) at Position(epoch, shard, first + k)."""

    epoch: int
    shard: int  # index into the stream's shares of the epoch
    first: int
    tokens: np.ndarray  # the shard's id dtype (widened for EOS if needed)
    bounds: np.ndarray  # int64, n + 1 ascending from 0
    prompt_lens: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def starting_at(self, doc: int) -> Run:
        """The run from its document ``doc`` (a Position's index) on."""
        k = doc - self.first
        if k <= 0:
            return self
        bounds = self.bounds[k:]
        prompts = None if self.prompt_lens is None else self.prompt_lens[k:]
        return Run(self.epoch, self.shard, doc, self.tokens[bounds[0] :], bounds - bounds[0], prompts)

    def position(self, cursor: int) -> Position:
        """The Position of the run's token ``cursor``."""
        k = int(np.searchsorted(self.bounds, cursor, side="right")) - 1
        return Position(self.epoch, self.shard, self.first + k, cursor - int(self.bounds[k]))

    def end(self) -> Position:
        """The Position right after the run."""
        return Position(self.epoch, self.shard, self.first + len(self), 0)


class DocumentReader:
    """The documents of one stream and one dataset, in the deterministic order described above, served as
    runs: whole shuffle blocks (``block`` documents permuted together) laid end to end once, no work per
    document."""

    def __init__(
        self,
        shard_set: ShardSet,
        seed: int,
        stream: int,
        streams: int,
        shuffle: bool,
        block: int,
        opener: ShardOpener,
        epochs: int | None,
        eos: int | None = None,
    ) -> None:
        self.shard_set, self.seed, self.stream, self.streams = shard_set, seed, stream, streams
        self.shuffle, self.block, self.opener, self.epochs = shuffle, block, opener, epochs
        self.eos = eos  # appended to every document (None: nothing)
        self.served = 0  # documents read so far

    def shares(self, epoch: int) -> list[Share]:
        """This stream's shares of the epoch: whole shards k, k+S, ... of the permutation, or, with fewer
        shards than streams, one contiguous part of shard k % N."""
        shards = self.shard_set.shards
        order = np.arange(len(shards))
        if self.shuffle:
            order = _rng(self.seed, epoch).permutation(order)
        n, k = len(shards), self.stream
        if n >= self.streams:
            return [Share(int(i), 0, shards[i].documents) for i in order[k :: self.streams]]
        shard = int(order[k % n])
        parts, part, docs = len(range(k % n, self.streams, n)), k // n, shards[shard].documents
        return [Share(shard, part * docs // parts, (part + 1) * docs // parts)]

    def runs(self, start: Position) -> Iterator[Run]:
        """The runs of documents from ``start`` on (the caller applies start.offset)."""
        epoch, shard_pos, doc_pos = start.epoch, start.shard, start.doc
        empty_epochs = 0
        while self.epochs is None or epoch < self.epochs:
            shares, served, whole_epoch = self.shares(epoch), self.served, shard_pos == 0 and doc_pos == 0
            while shard_pos < len(shares):
                base = doc_pos // self.block * self.block  # the start of the run holding doc_pos
                for run in self._share_runs(epoch, shard_pos, shares[shard_pos], base):
                    self.served += len(run)
                    if run.first + len(run) > doc_pos:  # (runs before the resume point are passed over)
                        yield run.starting_at(doc_pos)
                shard_pos, doc_pos = shard_pos + 1, 0
            # a stream whose shares were all skipped moves on to the next epoch (other shards), but never spins
            # through epochs without data
            empty_epochs = empty_epochs + 1 if whole_epoch and self.served == served else 0
            skipped = {self.shard_set.location(info) for info in self.shard_set.shards} <= set(self.opener.skipped)
            if empty_epochs and (skipped or empty_epochs > MAX_EMPTY_EPOCHS):
                raise DataError(
                    f"stream {self.stream} found no readable document in its shards of "
                    f"{self.shard_set.directory} in epoch {epoch} (all corrupt?)"
                )
            epoch, shard_pos = epoch + 1, 0

    def documents(self, start: Position) -> Iterator[tuple[np.ndarray, int, Position]]:
        """Yield (document tokens as int64, EOS appended if asked; its prompt length, 0 for text; its
        Position) from ``start`` on (the caller applies start.offset)."""
        for run in self.runs(start):
            bounds = run.bounds.tolist()
            prompts = itertools.repeat(0) if run.prompt_lens is None else run.prompt_lens.tolist()
            for k, (a, b, prompt_len) in enumerate(zip(bounds, bounds[1:], prompts)):
                yield run.tokens[a:b].astype(np.int64), prompt_len, Position(run.epoch, run.shard, run.first + k, 0)

    def _share_runs(self, epoch: int, shard_pos: int, share: Share, base: int) -> Iterator[Run]:
        """The share's documents from its ``base``-th (the start of a shuffle block) on, in runs of whole
        shuffle blocks holding at least RUN_TOKENS tokens (the last run: what is left)."""
        held: list[Block] = []  # documents read and not yet served
        tokens, first = 0, base
        for index, block in self.opener.blocks(self.shard_set, share):
            i, j = max(share.first + base - index, 0), min(share.stop - index, len(block))
            if i >= j:  # (before the resume point)
                continue
            piece = _documents(block, i, j)
            held.append(piece)
            tokens += len(piece.ids)
            if tokens >= RUN_TOKENS:
                docs = _joined(held)
                n = len(docs) // self.block * self.block
                if n:
                    yield self._run(epoch, shard_pos, share, first, _documents(docs, 0, n))
                    held, tokens, first = [_documents(docs, n, len(docs))], len(docs.ids) - docs.offsets[n], first + n
        if held and len(docs := _joined(held)):
            yield self._run(epoch, shard_pos, share, first, docs)

    def _run(self, epoch: int, shard_pos: int, share: Share, first: int, docs: Block) -> Run:
        """``docs`` as a run: each shuffle block permuted if shuffling, EOS appended if asked."""
        ids, starts, lengths, prompt_lens = docs.ids, docs.offsets[:-1], np.diff(docs.offsets), docs.prompt_lens
        if self.shuffle:
            order = self._order(epoch, share, first, len(docs))
            starts, lengths = starts[order], lengths[order]
            prompt_lens = None if prompt_lens is None else prompt_lens[order]
            ids = ids[np.arange(len(ids)) + np.repeat(starts - (np.cumsum(lengths) - lengths), lengths)]
        prompt_lens = None if prompt_lens is None else prompt_lens.astype(np.int64)
        extra = int(self.eos is not None)
        bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths + extra, out=bounds[1:])
        if not extra:
            return Run(epoch, shard_pos, first, ids, bounds, prompt_lens)
        tokens = np.empty(bounds[-1], dtype=_holding(ids.dtype, self.eos))
        tokens[bounds[1:] - 1] = self.eos
        tokens[np.arange(len(ids)) + np.repeat(np.arange(len(lengths)), lengths)] = ids
        return Run(epoch, shard_pos, first, tokens, bounds, prompt_lens)

    def _order(self, epoch: int, share: Share, first: int, n: int) -> np.ndarray:
        """The order in which documents [first, first + n) of the share are served: each shuffle block of them
        permuted on its own."""
        blocks = range(0, n, self.block)
        keys = [(self.seed, epoch, share.shard, share.first + first + s) for s in blocks]
        return np.concatenate([_rng(*key).permutation(min(self.block, n - s)) + s for key, s in zip(keys, blocks)])


def _documents(block: Block, i: int, j: int) -> Block:
    """Documents [i, j) of ``block``."""
    offsets = block.offsets[i : j + 1]
    prompt_lens = None if block.prompt_lens is None else block.prompt_lens[i:j]
    return Block(block.ids[offsets[0] : offsets[-1]], offsets - offsets[0], prompt_lens)


def _joined(blocks: list[Block]) -> Block:
    """The documents of ``blocks`` in order, as one block."""
    if len(blocks) == 1:
        return blocks[0]
    ends = np.cumsum([len(b.ids) for b in blocks])
    offsets = np.concatenate([[0]] + [b.offsets[1:] + end - len(b.ids) for b, end in zip(blocks, ends)])
    prompt_lens = None if blocks[0].prompt_lens is None else np.concatenate([b.prompt_lens for b in blocks])
    return Block(np.concatenate([b.ids for b in blocks]), offsets, prompt_lens)


@functools.cache
def _holding(dtype: np.dtype, value: int) -> np.dtype:
    """The smallest integer type holding ``dtype``'s values and ``value``."""
    return np.promote_types(dtype, np.min_scalar_type(value))


class WindowStream:
    """Cuts a reader's documents into the objective's windows (see the layouts in objectives.py);
    ``position`` always says where the next window starts."""

    def __init__(self, docs: DocumentReader, objective: Objective, eos: int, start: Position) -> None:
        self.docs, self.objective, self.eos = docs, objective, eos
        self.position = start
        if docs.shard_set.manifest.kind == INSTRUCTIONS:
            layouts = {"packed": self._packed, "rows": self._instruction_rows, "examples": self._instruction_examples}
        else:
            layouts = {"packed": self._packed, "rows": self._rows, "examples": self._examples}
        self._iter = layouts[objective.layout]()

    def __next__(self) -> Window:
        return next(self._iter)

    def _pieces(self) -> Iterator[tuple[np.ndarray, int, Position]]:
        """Documents (EOS appended if the objective wants it) with their prompt length (0 for text) from the
        current position; each Position's offset says where its unread part starts (non-zero only for the
        first one)."""
        start = self.position
        docs = self.docs.documents(start)
        for tokens, prompt_len, pos in docs:
            if (pos.epoch, pos.shard, pos.doc) == (start.epoch, start.shard, start.doc):
                pos.offset = start.offset
            yield tokens, prompt_len, pos
            break
        yield from docs

    def _packed(self) -> Iterator[Window]:
        """Windows cut from the documents laid end to end, ``overlap`` tokens shared by neighbours; a window
        reads across runs (and shards and epochs) where one ends."""
        size = self.objective.window
        stride = size - self.objective.overlap
        start = self.position
        pending: deque[Run] = deque()
        cursor = 0  # where the next window starts in pending[0].tokens
        available = 0  # tokens in pending from the cursor on
        for run in self.docs.runs(start):
            if not pending and (run.epoch, run.shard, run.first) == (start.epoch, start.shard, start.doc):
                cursor, available = start.offset, -start.offset
            pending.append(run)
            available += len(run.tokens)
            while available >= size:
                window = self._window(pending, cursor, size)
                cursor, available = cursor + stride, available - stride
                while pending and cursor >= len(pending[0].tokens):
                    cursor -= len(pending[0].tokens)
                    last = pending.popleft()
                self.position = pending[0].position(cursor) if pending else last.end()
                yield window

    def _window(self, pending: deque[Run], cursor: int, size: int) -> Window:
        """The ``size`` tokens from ``cursor`` of pending[0] on; segments number the documents (pieces) in it."""
        tokens, segments, prompts = [], [], []
        numbered = 0
        for run in pending:
            stop = min(cursor + size, len(run.tokens))
            doc = int(np.searchsorted(run.bounds, cursor, side="right")) - 1  # the document at the cursor
            later = run.bounds[doc + 1 : int(np.searchsorted(run.bounds, stop, side="left"))] - cursor
            starts = np.bincount(later, minlength=stop - cursor)  # documents starting at each token
            starts[0] += 1
            number = np.cumsum(starts)
            tokens.append(run.tokens[cursor:stop])
            segments.append(number + numbered)
            if run.prompt_lens is not None:
                docs = doc + number - 1
                prompts.append(np.arange(cursor, stop) - run.bounds[docs] < run.prompt_lens[docs])
            size -= stop - cursor
            if size == 0:
                break
            cursor, numbered = 0, numbered + int(number[-1])
        return Window(
            np.concatenate(tokens).astype(np.int64),
            np.concatenate(segments),
            np.concatenate(prompts) if prompts else None,
        )

    def _rows(self) -> Iterator[Window]:
        size, overlap, shortest = self.objective.window, self.objective.overlap, self.objective.min_tokens
        for tokens, _, pos in self._pieces():
            offset = pos.offset
            while len(tokens) - offset >= shortest:
                chunk = tokens[offset : offset + size]
                end = offset + len(chunk)
                offset = end - overlap if end < len(tokens) else len(tokens)
                self.position = Position(pos.epoch, pos.shard, pos.doc, offset)
                yield Window(chunk, np.ones(len(chunk), dtype=np.int64))
            self.position = Position(pos.epoch, pos.shard, pos.doc + 1, 0)

    def _examples(self) -> Iterator[Window]:
        """Pieces of at most ``window`` tokens packed whole into a row; a piece that would overflow the row is
        cut to the room left (when that room holds a useful piece), else it starts the next row."""
        obj = self.objective
        shortest = max(obj.min_tokens, obj.window // 8)
        row: list[np.ndarray] = []
        used = np.zeros(2, dtype=np.int64)
        for tokens, _, pos in self._pieces():
            offset = pos.offset
            while len(tokens) - offset >= obj.min_tokens:
                n = min(obj.window, len(tokens) - offset)
                if row:
                    n = _longest_fit(obj, used, n) if obj.packed else 0
                    if n < min(shortest, len(tokens) - offset):
                        self.position = Position(pos.epoch, pos.shard, pos.doc, offset)
                        yield _example_window(row)
                        row, used = [], np.zeros(2, dtype=np.int64)
                        continue
                row.append(tokens[offset : offset + n])
                used += obj.cost(n)
                offset += n
        if row:  # a finite (validation) stream ends with its last row
            yield _example_window(row)

    def _instruction_rows(self) -> Iterator[Window]:
        """One instruction example per row, cut to the row (``window`` tokens)."""
        size = self.objective.window
        for tokens, prompt_len, pos in self._pieces():
            self.position = Position(pos.epoch, pos.shard, pos.doc + 1, 0)
            if prompt_len >= size:
                _warn_once(self.docs.shard_set, "skipped", f"a {prompt_len}-token prompt fills the whole row")
                continue
            if len(tokens) > size:
                _warn_once(self.docs.shard_set, "truncated", f"{len(tokens)} tokens > data.seq_len + 1")
            chunk = tokens[:size]
            yield Window(chunk, np.ones(len(chunk), dtype=np.int64), np.arange(len(chunk)) < prompt_len)

    def _instruction_examples(self) -> Iterator[Window]:
        """Encoder-decoder: whole examples (prompt -> encoder, completion -> decoder) packed into rows while
        both sides fit; a side longer than a row is cut to it."""
        obj = self.objective
        src_room, tgt_room = (int(c) for c in obj.capacity)
        row: list[tuple[np.ndarray, np.ndarray]] = []
        used = np.zeros(2, dtype=np.int64)
        for tokens, prompt_len, pos in self._pieces():
            if prompt_len == 0:
                _warn_once(self.docs.shard_set, "skipped", "an empty prompt leaves the encoder nothing to read")
                continue
            source, target = tokens[:prompt_len], tokens[prompt_len:]
            if len(source) > src_room or len(target) > tgt_room:
                _warn_once(
                    self.docs.shard_set,
                    "truncated",
                    f"{len(source)} prompt + {len(target)} completion tokens, data.seq_len={src_room} per side",
                )
                source, target = source[:src_room], target[:tgt_room]
            cost = np.array([len(source), len(target)])
            if row and (not obj.packed or (used + cost > obj.capacity).any()):
                self.position = Position(pos.epoch, pos.shard, pos.doc, 0)
                yield _example_window([t for t, _ in row], [p for _, p in row])
                row, used = [], np.zeros(2, dtype=np.int64)
            row.append((np.concatenate([source, target]), np.arange(len(source) + len(target)) < len(source)))
            used += cost
        if row:
            yield _example_window([t for t, _ in row], [p for _, p in row])


_WARNED: set[tuple[str, str]] = set()


def _warn_once(shard_set: ShardSet, what: str, example: str) -> None:
    """Warn once per process and dataset that instruction examples are ``what`` ("truncated": their end is cut
    off; "skipped": nothing left to learn), with the first case as ``example``."""
    if (str(shard_set.directory), what) in _WARNED:
        return
    _WARNED.add((str(shard_set.directory), what))
    consequence = "their end is cut off" if what == "truncated" else "they are skipped"
    warnings.warn(
        f"some instruction examples of {shard_set.directory} do not fit a row (e.g. {example}): "
        f"{consequence}; raise data.seq_len to keep them whole",
        stacklevel=3,
    )


def _longest_fit(obj: Objective, used: np.ndarray, n: int) -> int:
    """The longest piece of at most n tokens that still fits the row (0 if none); costs grow with n."""
    low, high = 0, n
    while low < high:
        mid = (low + high + 1) // 2
        if mid >= obj.min_tokens and (used + obj.cost(mid) <= obj.capacity).all():
            low = mid
        else:
            high = mid - 1
    return low


def _example_window(pieces: list[np.ndarray], prompts: list[np.ndarray] | None = None) -> Window:
    segments = np.concatenate([np.full(len(p), k + 1, dtype=np.int64) for k, p in enumerate(pieces)])
    return Window(np.concatenate(pieces), segments, None if prompts is None else np.concatenate(prompts))


class StreamSamples:
    """The samples of one stream: its datasets mixed by weight, the objective applied with a per-sample seed."""

    def __init__(self, spec: LoaderSpec, stream: int, state: dict | None, opener: ShardOpener) -> None:
        shard_sets = spec.shard_sets
        state = state or {"samples": 0, "positions": [Position().as_dict() for _ in shard_sets]}
        self.seed, self.salt, self.stream, self.samples = spec.seed, spec.salt, stream, state["samples"]
        self.objective = spec.objective
        self.weights = np.array([s.weight for s in shard_sets]) / sum(s.weight for s in shard_sets)
        self.windows = [
            WindowStream(
                DocumentReader(
                    s,
                    spec.seed,
                    stream,
                    spec.streams,
                    spec.shuffle,
                    spec.block,
                    opener,
                    spec.epochs,
                    spec.eos if spec.objective.doc_eos else None,
                ),
                spec.objective,
                spec.eos,
                Position(**p),
            )
            for s, p in zip(shard_sets, state["positions"])
        ]

    def __next__(self) -> dict[str, np.ndarray]:
        """The next sample; StopIteration when a finite stream ends (when its first dataset does)."""
        mixed = len(self.windows) > 1
        rng = _rng(self.seed, self.salt, self.stream, self.samples) if mixed or self.objective.random else None
        choice = int(rng.choice(len(self.windows), p=self.weights)) if mixed else 0
        window = next(self.windows[choice])
        self.samples += 1
        return self.objective.build(window, rng)

    def state(self) -> dict:
        return {"samples": self.samples, "positions": [w.position.as_dict() for w in self.windows]}


def _stack(rows: list[torch.Tensor], pin_memory: bool) -> torch.Tensor:
    """Rows into one batch tensor, written straight into page-locked memory when asked."""
    if not pin_memory:
        return torch.stack(rows)
    out = torch.empty((len(rows), *rows[0].shape), dtype=rows[0].dtype, pin_memory=True)
    return torch.stack(rows, out=out)


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.stack([s[key] for s in samples]).astype(np.int64)) for key in samples[0]}


# ------------------------------------------------------------------------------------------- loader


@dataclass
class LoaderSpec:
    shard_sets: list[ShardSet]
    objective: Objective
    eos: int
    seed: int
    salt: int
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    num_workers: int
    shuffle: bool
    block: int
    on_corrupt: str
    epochs: int | None
    streams: int
    retry: Retry
    pin_memory: bool = False

    @property
    def workers_per_rank(self) -> int:
        return max(1, self.num_workers)

    def stream_of(self, local_row: int) -> int:
        """The stream of this rank's local row ``local_row`` (global row dp_rank + dp_size * local_row)."""
        return (self.dp_rank + self.dp_size * local_row) % self.streams


@dataclass
class _Chunk:
    """Rows a worker made: its local rows start + worker + W * (round * n + u), u < n."""

    worker: int
    round: int
    batch: dict[str, torch.Tensor]  # [n, ...] per key
    states: list[tuple[int, dict]]  # per row: (stream, the stream's state after the row)
    skipped: list[str]


class _Rows(IterableDataset):
    """Runs inside each DataLoader worker (or in the main process): this worker's rows, in chunks."""

    def __init__(self, spec: LoaderSpec, start: int, states: dict[int, dict], skipped: list[str]) -> None:
        self.spec, self.start, self.states, self.skipped = spec, start, states, skipped

    def __iter__(self) -> Iterator[_Chunk | DataError]:
        try:
            yield from self._chunks()
        except DataError as err:
            if get_worker_info() is None:
                raise
            yield err  # from a worker process: as it is, not wrapped in a message with the worker's traceback

    def _chunks(self) -> Iterator[_Chunk]:
        spec = self.spec
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        # the streams this worker's rows visit, in order; the cycle repeats (workers * dp_size divides streams)
        cycle = [
            spec.stream_of(self.start + worker + workers * t) for t in range(spec.streams // (spec.dp_size * workers))
        ]
        opener = ShardOpener(spec.on_corrupt, spec.retry, list(self.skipped))
        streams = {k: StreamSamples(spec, k, self.states.get(k), opener) for k in cycle}
        size = spec.micro_batch_size
        turn = 0  # index into cycle of the stream of the next row
        for round_ in itertools.count():
            rows, states = [], []
            while len(rows) < size and cycle:
                k = cycle[turn]
                try:
                    rows.append(next(streams[k]))
                except StopIteration:  # finite loaders only: the exhausted stream leaves the cycle
                    del cycle[turn]
                    turn = turn % len(cycle) if cycle else 0
                    continue
                states.append((k, streams[k].state()))
                turn = (turn + 1) % len(cycle)
            if not rows:
                return
            yield _Chunk(worker, round_, collate(rows), states, list(opener.skipped))


def _same(item):
    return item


class StreamingLoader:
    """Iterate for batches (dicts of tensors); ``state_dict()`` after batch k resumes at batch k + 1.

    Train loaders are endless; a validation loader yields the same finite sequence of batches on every
    iteration (and on every rank), the last one smaller when the split's rows do not fill it.
    """

    def __init__(self, spec: LoaderSpec) -> None:
        self.spec = spec
        self.rows = 0  # local rows consumed (handed out in batches)
        self.stream_states: dict[int, dict] = {}
        self.skipped: list[str] = []
        self.skip: list[tuple[int, int]] = []  # global row ranges [start, stop) read but not handed out

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        spec = self.spec
        if not spec.shuffle:  # validation: the same batches, from the beginning, every time
            self.rows, self.stream_states = 0, {}
        dataset = _Rows(spec, self.rows, dict(self.stream_states), list(self.skipped))
        loader = DataLoader(
            dataset, batch_size=None, num_workers=spec.num_workers, collate_fn=_same, persistent_workers=False
        )
        pending: deque = deque()  # rows in local order: (tensors of one row, (stream, state))
        chunks: list[_Chunk] = []  # of the current round, one per worker
        produced = 0
        for chunk in loader:
            if isinstance(chunk, DataError):
                raise chunk
            if chunks and chunk.round != chunks[0].round:  # a finite loader lost a worker
                pending.extend(_interleave(chunks))
                chunks = []
            chunks.append(chunk)
            if len(chunks) == spec.workers_per_rank:
                pending.extend(_interleave(chunks))
                chunks = []
            self._note_skipped(chunk.skipped)
            while self._drop_skipped(pending) >= spec.micro_batch_size:
                produced += 1
                yield self._take(pending)
        pending.extend(_interleave(chunks))
        while self._drop_skipped(pending) >= spec.micro_batch_size:
            produced += 1
            yield self._take(pending)
        if pending and not spec.shuffle:  # validation counts every row: a last, smaller batch
            produced += 1
            yield self._take(pending, len(pending))
        if produced == 0 and not spec.shuffle:
            raise DataError(
                f"the {spec.shard_sets[0].split} split of {spec.shard_sets[0].directory} holds no sequences; "
                "shard with validation documents (--valid-every) or set data.valid to a dataset"
            )

    def _take(self, pending: deque, size: int | None = None) -> dict[str, torch.Tensor]:
        rows = [pending.popleft() for _ in range(size or self.spec.micro_batch_size)]
        for _, (stream, state) in rows:
            self.stream_states[stream] = state
        self.rows += len(rows)
        return {key: _stack([tensors[key] for tensors, _ in rows], self.spec.pin_memory) for key in rows[0][0]}

    def skip_rows(self, start: int, stop: int) -> None:
        """Read global rows [start, stop) but hand none of them out (data a rollback steps over). The range
        is widened to whole micro batches of every rank, so all ranks drop as many rows; the next iteration
        (and every resume from this state) drops them."""
        unit = self.spec.dp_size * self.spec.micro_batch_size
        self.skip = _merged([*self.skip, (start // unit * unit, -(-stop // unit) * unit)])

    def _drop_skipped(self, pending: deque) -> int:
        """Consume the rows at the front of ``pending`` that fall in a skipped range; the rows left."""
        while pending and self._skipped(self.spec.dp_rank + self.spec.dp_size * self.rows):
            _, (stream, state) = pending.popleft()
            self.stream_states[stream] = state
            self.rows += 1
        return len(pending)

    def _skipped(self, row: int) -> bool:
        return any(start <= row < stop for start, stop in self.skip)

    def _note_skipped(self, skipped: list[str]) -> None:
        self.skipped += [s for s in skipped if s not in self.skipped]

    def state_dict(self) -> dict:
        spec = self.spec
        return {
            "format": STATE_FORMAT,
            "streams": spec.streams,
            "dp_rank": spec.dp_rank,
            "dp_size": spec.dp_size,
            "rows": self.rows,
            "stream_states": {str(k): v for k, v in sorted(self.stream_states.items())},
            "skipped": list(self.skipped),
            "sources": [s.fingerprint for s in spec.shard_sets],  # (the saved key: the datasets' fingerprints)
            "skip_rows": [list(r) for r in self.skip],
        }

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Continue from a state of this rank (same layout), of a one-rank run, or ``merge_states`` of all
        ranks of a run (a list of per-rank states is merged here): any layout continues the global rows."""
        spec = self.spec
        if isinstance(state, list):
            state = merge_states(state)
        _check_format(state)
        if state["streams"] != spec.streams:
            raise DataError(
                f"the data-loader state was saved with data.streams={state['streams']}, this run has "
                f"data.streams={spec.streams}; set data.streams={state['streams']} to resume it"
            )
        fingerprints = [s.fingerprint for s in spec.shard_sets]
        if state["sources"] != fingerprints:
            raise DataError(
                f"data.{spec.shard_sets[0].split} holds other shards than when the checkpoint was saved; "
                "exact resume needs the same datasets (use init_from= to start a new run from the "
                "weights)"
            )
        streams = {int(k): v for k, v in state["stream_states"].items()}
        if (state["dp_size"], state["dp_rank"]) == (spec.dp_size, spec.dp_rank):
            rows = state["rows"]
            _check_counts(streams, spec.dp_rank, spec.dp_size, rows, spec.streams)
        elif state["dp_size"] == 1:  # the whole sequence: take this rank's share of it
            total = state["rows"]
            if total % spec.dp_size:
                raise DataError(
                    f"the data-loader state is at global row {total}, which {spec.dp_size} "
                    "data-parallel ranks cannot split evenly; keep the global batch size a multiple "
                    "of the data-parallel size"
                )
            _check_counts(streams, 0, 1, total, spec.streams)
            rows = total // spec.dp_size
            streams = {k: v for k, v in streams.items() if k % spec.dp_size == spec.dp_rank}
        else:
            raise DataError(
                f"the data-loader state belongs to data-parallel rank {state['dp_rank']} of "
                f"{state['dp_size']}, not to rank {spec.dp_rank} of {spec.dp_size}; load the states "
                "of all ranks (merge_states) to resume on another layout"
            )
        self.rows, self.stream_states, self.skipped = rows, streams, list(state["skipped"])
        self.skip = _merged(tuple(r) for r in state.get("skip_rows", []))

    @property
    def skipped_shards(self) -> list[str]:
        """Corrupt shards skipped so far (data.on_corrupt=skip), for the metrics."""
        return sorted(self.skipped)

    def metrics(self) -> dict[str, float]:
        return {
            "data/skipped_shards": float(len(self.skipped_shards)),
            "data/epoch": float(
                max((p["epoch"] for st in self.stream_states.values() for p in st["positions"]), default=0)
            ),
        }

    def tokens_per_epoch(self) -> int:
        """Tokens of one pass over the split (all datasets), from the manifests."""
        return sum(s.manifest.tokens(s.split) for s in self.spec.shard_sets)


def _interleave(chunks: list[_Chunk]) -> Iterator[tuple[dict[str, torch.Tensor], tuple[int, dict]]]:
    """The rows of one round of chunks (one per worker, in worker order) in local row order: row u of every
    worker, then row u + 1, ..."""
    for u in range(max((len(c.states) for c in chunks), default=0)):
        for c in chunks:
            if u < len(c.states):
                yield {key: value[u] for key, value in c.batch.items()}, c.states[u]


def _merged(ranges) -> list[tuple[int, int]]:
    """Row ranges [start, stop) sorted, the overlapping and touching ones joined."""
    out: list[tuple[int, int]] = []
    for start, stop in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        elif stop > start:
            out.append((start, stop))
    return out


def _check_format(state: dict) -> None:
    if state.get("format") != STATE_FORMAT:
        raise DataError(
            "the data-loader state was written by an older version (per-reader positions, before "
            "data.streams); it cannot be resumed exactly: start a new run from its weights with "
            "init_from="
        )


def _check_counts(streams: dict[int, dict], rank: int, dp_size: int, rows: int, n_streams: int) -> None:
    """After ``rows`` local rows of rank ``rank`` of ``dp_size`` (global rows rank + dp_size * i), every stream
    has made one sample per such row that falls on it."""
    period = n_streams // dp_size  # a rank's rows visit its streams in turn
    for k in range(rank, n_streams, dp_size):
        first = (k - rank) // dp_size  # the rank's first local row on stream k
        expected = max(0, -(-(rows - first) // period))
        made = streams.get(k, {"samples": 0})["samples"]
        if made != expected:
            raise DataError(
                f"the data-loader state is inconsistent: stream {k} made {made} samples, {expected} "
                f"expected after {rows} rows of rank {rank} of {dp_size} (states of ranks from "
                "different steps?)"
            )


def merge_states(states: list[dict]) -> dict:
    """The states of all data-parallel ranks of one run (tensor-parallel peers may repeat) as one state of the
    global row sequence, which ``load_state_dict`` accepts on any layout."""
    if not states:
        raise DataError("merge_states needs the data-loader states of all data-parallel ranks, got none")
    for state in states:
        _check_format(state)
    first = states[0]
    by_rank = {s["dp_rank"]: s for s in states}
    if sorted(by_rank) != list(range(first["dp_size"])):
        raise DataError(
            f"merge_states needs the states of data-parallel ranks 0..{first['dp_size'] - 1}, got "
            f"ranks {sorted(by_rank)}"
        )
    for s in states:
        same = (s["streams"], s["dp_size"], s["sources"]) == (first["streams"], first["dp_size"], first["sources"])
        if not same or s["rows"] != first["rows"]:
            raise DataError(
                "the data-loader states of the ranks do not belong together (other streams, layout, "
                "datasets or rows consumed)"
            )
    streams = {k: v for s in by_rank.values() for k, v in s["stream_states"].items()}
    skipped = sorted({p for s in states for p in s["skipped"]})
    skip_rows = _merged(tuple(r) for s in states for r in s.get("skip_rows", []))
    return {
        "format": STATE_FORMAT,
        "streams": first["streams"],
        "dp_rank": 0,
        "dp_size": 1,
        "rows": first["rows"] * first["dp_size"],
        "stream_states": streams,
        "skipped": skipped,
        "sources": first["sources"],
        "skip_rows": [list(r) for r in skip_rows],
    }


def check_data(settings: LoaderSettings, tokenizer: TokenizerInfo) -> None:
    """The checks a loader makes when built, of both splits, from the manifests alone: a run can make them
    before its engines start."""
    data = settings.data
    retry = Retry(data.retries, settings.retry_wait)
    shard_sets = resolve_datasets(data.train, "train", retry) + resolve_datasets(
        data.valid, "valid", retry, fallback=data.train
    )
    check_compatible(shard_sets, tokenizer, settings.vocab_size)
    check_instructions(shard_sets, settings.objective)


def build_loader(
    settings: LoaderSettings,
    split: str,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    tokenizer: TokenizerInfo,
    epochs: int | None = None,
) -> StreamingLoader:
    """The loader of ``split``: "train" is endless and shuffled, split over ``dp_size`` ranks x
    ``num_workers`` workers; "valid" is ``epochs`` (default 1) in-order passes, the same on every rank."""
    s, data = settings, settings.data
    if split not in SPLIT_SALT:
        raise DataError(f"split must be train or valid, got {split!r}")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
    retry = Retry(data.retries, s.retry_wait)
    shard_sets = (
        resolve_datasets(data.valid, "valid", retry, fallback=data.train)
        if split == "valid"
        else resolve_datasets(data.train, "train", retry)
    )
    check_compatible(shard_sets, tokenizer, s.vocab_size)
    check_instructions(shard_sets, s.objective)
    if data.on_corrupt == "error":  # a missing local shard fails now, not hours into the run (checksums: when read)
        missing = [path for src in shard_sets if not src.remote for path in src.missing()]
        if missing:
            raise DataError(
                f"{len(missing)} shard(s) listed in the manifest are missing, e.g. {missing[0]} "
                "(restore them, re-shard, or set data.on_corrupt=skip)"
            )
    workers, streams = (data.num_workers, data.streams) if split == "train" else (0, 1)
    if split == "valid":  # validation shards are few: every rank reads all of them, in order, as one stream
        dp_rank, dp_size, epochs = 0, 1, epochs or 1
    check_streams(shard_sets, streams, dp_size, workers)
    objective = build_objective(s.objective, s.arch, data.seq_len, data.pack, tokenizer, s.objective_args)
    eos = tokenizer.require("eos", "document separation")
    spec = LoaderSpec(
        shard_sets,
        objective,
        eos,
        s.seed,
        SPLIT_SALT[split],
        micro_batch_size,
        dp_rank,
        dp_size,
        workers,
        split == "train",
        max(1, data.shuffle_buffer // streams),
        data.on_corrupt,
        epochs,
        streams,
        retry,
        s.pin_memory,
    )
    return StreamingLoader(spec)
