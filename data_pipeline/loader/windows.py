"""Documents cut into the objective's windows, and one stream's samples: its datasets mixed by weight, the
objective applied."""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterator

import numpy as np
import torch

from data_pipeline.loader.blocks import ShardOpener
from data_pipeline.loader.reader import DocumentReader, Position, Run, keyed_rng
from data_pipeline.loader.sources import ShardSet
from data_pipeline.loader.spec import LoaderSpec
from data_pipeline.objectives import Objective, Window
from data_pipeline.shard import INSTRUCTIONS


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
        rng = keyed_rng(self.seed, self.salt, self.stream, self.samples) if mixed or self.objective.random else None
        choice = int(rng.choice(len(self.windows), p=self.weights)) if mixed else 0
        window = next(self.windows[choice])
        self.samples += 1
        return self.objective.build(window, rng)

    def state(self) -> dict:
        return {"samples": self.samples, "positions": [w.position.as_dict() for w in self.windows]}


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.stack([s[key] for s in samples]).astype(np.int64)) for key in samples[0]}
