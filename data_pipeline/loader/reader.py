"""One stream's documents of one dataset: shares of shards, shuffled in blocks, served in runs, with the
position to resume from."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data_pipeline import DataError
from data_pipeline.loader.blocks import ShardOpener, Share
from data_pipeline.loader.sources import ShardSet
from data_pipeline.shard import Block

MAX_EMPTY_EPOCHS = 100  # epochs in a row in which a stream's shares were all corrupt: then it fails
RUN_TOKENS = 1 << 16  # documents are served in runs of whole shuffle blocks of at least this many tokens


@dataclass
class Position:
    epoch: int = 0
    shard: int = 0  # index into this stream's shard list of the epoch
    doc: int = 0  # index into the (block-permuted) documents of that shard (part)
    offset: int = 0  # tokens of that document already consumed

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "doc": self.doc, "offset": self.offset}


def keyed_rng(*key: int) -> np.random.Generator:
    """A generator seeded by the integers of ``key`` (each taken modulo 2**32)."""
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
            order = keyed_rng(self.seed, epoch).permutation(order)
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
        return np.concatenate([keyed_rng(*key).permutation(min(self.block, n - s)) + s for key, s in zip(keys, blocks)])


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
