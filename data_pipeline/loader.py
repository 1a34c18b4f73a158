"""The streaming loader: shards -> documents -> windows -> objective samples -> batches, resumable exactly.

Who reads what. The data-parallel ranks times the DataLoader workers form ``n_readers`` readers. In epoch
``e`` the shards are permuted with ``(seed, e)`` and reader ``r`` reads shards ``r, r + n_readers, ...``;
inside a shard, blocks of ``data.shuffle_buffer`` documents are permuted with ``(seed, e, shard, block)``
(a bounded shuffle: memory holds one block of one shard per reader). So every reader's stream is a pure
function of the seed and its position: no shared state, no coordination.

Exact resume. A reader's position is ``{epoch, shard, doc, offset}`` (the next window starts ``offset``
tokens into that document) plus its sample counter; objectives seed their randomness per sample. Workers
send their position with every batch, the main process keeps the latest one per reader, and
``state_dict()`` is that small dict. Restarting from it, every reader continues where it stopped, and the
batch order across workers continues too (the worker that was next is mapped to DataLoader worker 0).

Instruction data. Examples from a ``prompt_completion`` shard directory keep their prompt marked through the
pipeline (``Window.prompt``): the objectives give its tokens no loss. A decoder packs them into rows like
documents (a piece cut at a row boundary keeps what it holds of its prompt), or with ``data.pack: false``
gives each its own row; an encoder-decoder reads each whole (prompt -> encoder, completion -> decoder),
several per row when packed. An example longer than its row is truncated, one whose prompt leaves no room
to learn anything is skipped; both are warned about.

No hang. Training streams are endless (epochs roll over, reshuffled), so every rank can take as many steps
as the trainer asks for; a rank never runs out first. Validation is one pass over the validation shards in
order, identical on every rank and every time.
"""

from __future__ import annotations

import hashlib
import warnings
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline import DataError
from data_pipeline.objectives import Objective, Window, build_objective
from data_pipeline.shard import INSTRUCTIONS, Manifest, ShardInfo, decode_ids
from data_pipeline.tokenizer import TokenizerInfo
from megatransformer.config import DatasetSource, ModelConfig, RunConfig

SPLIT_SALT = {"train": 0, "valid": 1}


@dataclass
class Source:
    directory: Path
    split: str
    shards: list[ShardInfo]
    weight: float
    manifest: Manifest

    @property
    def fingerprint(self) -> str:
        """Identifies the shards' content (not their location), for resume checks."""
        return hashlib.sha256("".join(s.sha256 for s in self.shards).encode()).hexdigest()[:16]


def resolve_sources(spec: Any, split: str, fallback: Any = None) -> list[Source]:
    """``data.train`` / ``data.valid`` (a directory or a list of {path, weight}) as Sources of one split."""
    spec = spec if spec is not None else fallback
    if spec is None:
        raise DataError(f"data.{split} is not set; point it at a directory written by `megatransformer data shard`")
    entries = [DatasetSource(path=spec)] if isinstance(spec, str) else spec
    sources = []
    for entry in entries:
        manifest = Manifest.load(entry.path)
        shards = manifest.splits.get(split, [])
        if not shards:
            hint = "; set data.valid or re-shard with --valid-every N" if split == "valid" else ""
            raise DataError(f"{entry.path} has no {split} shards (its manifest lists {sorted(manifest.splits)}){hint}")
        if entry.weight <= 0:
            raise DataError(f"data.{split}: weight of {entry.path} must be positive, got {entry.weight}")
        sources.append(Source(Path(entry.path), split, shards, entry.weight, manifest))
    return sources


def check_compatible(sources: list[Source], tok: TokenizerInfo, model: ModelConfig) -> None:
    """Shards, tokenizer and model must agree on the token ids; checked before any step is taken."""
    for source in sources:
        m = source.manifest
        if m.tokenizer_sha256 != tok.sha256:
            raise DataError(f"{source.directory} was tokenized with another tokenizer than data.tokenizer="
                            f"{tok.path} (sha256 {m.tokenizer_sha256[:12]} vs {tok.sha256[:12]}); re-shard it")
        if m.vocab_size != tok.vocab_size or np.iinfo(m.dtype).max < m.vocab_size - 1:
            raise DataError(f"{source.directory}: manifest says vocab {m.vocab_size} in {m.dtype}, the tokenizer "
                            f"has {tok.vocab_size} tokens; re-shard it")
    if tok.vocab_size > model.vocab_size:
        raise DataError(f"tokenizer {tok.path} has {tok.vocab_size} tokens but model.vocab_size={model.vocab_size}; "
                        f"set model.vocab_size >= {tok.vocab_size}")


def check_instructions(sources: list[Source], cfg: RunConfig) -> None:
    """Instruction (prompt, completion) shards need an objective that can leave the prompt unscored."""
    instructions = [s for s in sources if s.manifest.kind == INSTRUCTIONS]
    if not instructions:
        return
    where = instructions[0].directory
    if cfg.objective not in ("autoregressive", "prefix_lm"):
        raise DataError(f"{where} holds prompt/completion examples, which objective={cfg.objective} cannot use; "
                        "train them with objective=autoregressive or objective=prefix_lm")


# ------------------------------------------------------------------------------------------- readers


@dataclass
class Position:
    epoch: int = 0
    shard: int = 0  # index into this reader's shard list of the epoch
    doc: int = 0  # index into the shard's (block-permuted) documents
    offset: int = 0  # tokens of that document already consumed

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "doc": self.doc, "offset": self.offset}


_VERIFIED: set[tuple[str, int, int, str]] = set()  # (path, size, mtime, sha256) checked in this process


@dataclass
class ShardOpener:
    """Opens shards after checking them against the manifest; a corrupt one raises or, with
    on_corrupt=skip, is warned about, remembered (in the loader state) and skipped."""

    on_corrupt: str
    skipped: list[str] = field(default_factory=list)

    def open(self, source: Source, info: ShardInfo) -> Iterator[tuple[bytes, bytes | None]] | None:
        path = source.directory / info.file
        if str(path) in self.skipped:
            return None
        try:
            verify_shard(path, info)
        except (OSError, DataError) as err:
            message = f"corrupt shard {path}: {err}"
            if self.on_corrupt == "error":
                raise DataError(message + " (set data.on_corrupt=skip to skip it)") from None
            warnings.warn(message + "; skipping it (data.on_corrupt=skip)", stacklevel=2)
            self.skipped.append(str(path))
            return None
        return _samples(path, info)


def verify_shard(path: Path, info: ShardInfo) -> None:
    """Size-and-checksum check against the manifest (once per file version and process)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns, info.sha256)
    if key in _VERIFIED:
        return
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    if digest.hexdigest() != info.sha256:
        raise DataError("its sha256 differs from the manifest's (truncated or modified after writing)")
    _VERIFIED.add(key)


def _samples(path: Path, info: ShardInfo) -> Iterator[tuple[bytes, bytes | None]]:
    """The encoded token arrays (and prompt lengths, if any) of a (verified) shard, streamed with webdataset."""
    import webdataset as wds

    count = 0
    try:
        for sample in wds.WebDataset(str(path), shardshuffle=False, nodesplitter=_all, workersplitter=_all,
                                     empty_check=False):
            count += 1
            yield sample["ids.npy"], sample.get("prompt_len")
    except Exception as err:  # noqa: BLE001 - any read error of a verified shard means it changed under us
        raise DataError(f"shard {path} failed while reading (changed on disk?): {err}") from None
    if count != info.samples:
        raise DataError(f"shard {path} holds {count} samples, its manifest says {info.samples}")


def _all(urls):
    return urls


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k & 0xFFFFFFFF for k in key])


class DocumentReader:
    """The documents of one reader and one source, in the deterministic order described above."""

    def __init__(self, source: Source, seed: int, reader: int, n_readers: int, shuffle: bool, block: int,
                 opener: ShardOpener, epochs: int | None) -> None:
        self.source, self.seed, self.reader, self.n_readers = source, seed, reader, n_readers
        self.shuffle, self.block, self.opener, self.epochs = shuffle, block, opener, epochs

    def shard_order(self, epoch: int) -> list[int]:
        order = np.arange(len(self.source.shards))
        if self.shuffle:
            order = _rng(self.seed, epoch).permutation(order)
        return [int(i) for i in order[self.reader::self.n_readers]]

    def documents(self, start: Position) -> Iterator[tuple[np.ndarray, int | None, Position]]:
        """Yield (document tokens, its prompt length or None, its Position) from ``start`` on (the caller
        applies start.offset)."""
        epoch, shard_pos, doc_pos = start.epoch, start.shard, start.doc
        while self.epochs is None or epoch < self.epochs:
            shards, found, whole_epoch = self.shard_order(epoch), False, shard_pos == 0 and doc_pos == 0
            while shard_pos < len(shards):
                samples = self.opener.open(self.source, self.source.shards[shards[shard_pos]])
                if samples is not None:
                    for d, (data, prompt_len) in self._ordered(samples, epoch, shards[shard_pos], doc_pos):
                        found = True
                        prompt_len = None if prompt_len is None else int(prompt_len)
                        yield decode_ids(data), prompt_len, Position(epoch, shard_pos, d, 0)
                shard_pos, doc_pos = shard_pos + 1, 0
            if whole_epoch and not found:  # never spin through epochs without data
                raise DataError(f"reader {self.reader} found no readable document in its shards of "
                                f"{self.source.directory} in epoch {epoch} (all corrupt?)")
            epoch, shard_pos = epoch + 1, 0

    def _ordered(self, samples: Iterator, epoch: int, shard: int, first: int) -> Iterator[tuple[int, Any]]:
        """(index, sample) from index ``first`` on, each block of ``self.block`` samples permuted."""
        block: list = []
        base = 0
        for data in samples:
            block.append(data)
            if len(block) == self.block:
                yield from self._emit(block, base, epoch, shard, first)
                base, block = base + len(block), []
        yield from self._emit(block, base, epoch, shard, first)

    def _emit(self, block: list, base: int, epoch: int, shard: int, first: int):
        if base + len(block) <= first:  # before the resume point: skipped without decoding
            return
        order = _rng(self.seed, epoch, shard, base).permutation(len(block)) if self.shuffle else range(len(block))
        for j in range(max(first - base, 0), len(block)):
            yield base + j, block[order[j]]


class WindowStream:
    """Cuts a reader's documents into the objective's windows (see the layouts in objectives.py);
    ``position`` always says where the next window starts."""

    def __init__(self, docs: DocumentReader, objective: Objective, eos: int, start: Position) -> None:
        self.docs, self.objective, self.eos = docs, objective, eos
        self.position = start
        if docs.source.manifest.kind == INSTRUCTIONS:
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
        for tokens, prompt_len, pos in self.docs.documents(start):
            if self.objective.doc_eos:
                tokens = np.append(tokens, self.eos)
            if (pos.epoch, pos.shard, pos.doc) == (start.epoch, start.shard, start.doc):
                pos.offset = start.offset
            yield tokens.astype(np.int64), prompt_len or 0, pos

    def _packed(self) -> Iterator[Window]:
        size = self.objective.window
        stride = size - self.objective.overlap
        marks_prompts = self.docs.source.manifest.kind == INSTRUCTIONS
        pending: deque[list] = deque()  # [tokens, Position, first unread offset, prompt length]
        available = 0
        for tokens, prompt_len, pos in self._pieces():
            pending.append([tokens, pos, pos.offset, prompt_len])
            available += len(tokens) - pos.offset
            while available >= size:
                chunks, segments, prompts, need = [], [], [], size
                for k, (t, _, s, p) in enumerate(pending):
                    take = min(need, len(t) - s)
                    chunks.append(t[s:s + take])
                    segments.append(np.full(take, k + 1, dtype=np.int64))
                    if marks_prompts:
                        prompts.append(np.arange(s, s + take) < p)
                    need -= take
                    if need == 0:
                        break
                self._advance(pending, stride, pos)
                available -= stride
                yield Window(np.concatenate(chunks), np.concatenate(segments),
                             np.concatenate(prompts) if marks_prompts else None)

    def _advance(self, pending: deque, count: int, last: Position) -> None:
        while count:
            t, _, s, _ = pending[0]
            take = min(count, len(t) - s)
            pending[0][2] += take
            count -= take
            if pending[0][2] == len(t):
                pending.popleft()
        if pending:
            _, p, s, _ = pending[0]
            self.position = Position(p.epoch, p.shard, p.doc, s)
        else:  # the next window starts with the next document
            self.position = Position(last.epoch, last.shard, last.doc + 1, 0)

    def _rows(self) -> Iterator[Window]:
        size, overlap, shortest = self.objective.window, self.objective.overlap, self.objective.min_tokens
        for tokens, _, pos in self._pieces():
            offset = pos.offset
            while len(tokens) - offset >= shortest:
                chunk = tokens[offset:offset + size]
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
                row.append(tokens[offset:offset + n])
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
                _warn_once(self.docs.source, "skipped", f"a {prompt_len}-token prompt fills the whole row")
                continue
            if len(tokens) > size:
                _warn_once(self.docs.source, "truncated", f"{len(tokens)} tokens > data.seq_len + 1")
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
                _warn_once(self.docs.source, "skipped", "an empty prompt leaves the encoder nothing to read")
                continue
            source, target = tokens[:prompt_len], tokens[prompt_len:]
            if len(source) > src_room or len(target) > tgt_room:
                _warn_once(self.docs.source, "truncated", f"{len(source)} prompt + {len(target)} completion "
                           f"tokens, data.seq_len={src_room} per side")
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


def _warn_once(source: Source, what: str, example: str) -> None:
    """Warn once per process and source that instruction examples are ``what`` ("truncated": their end is cut
    off; "skipped": nothing left to learn), with the first case as ``example``."""
    if (str(source.directory), what) in _WARNED:
        return
    _WARNED.add((str(source.directory), what))
    consequence = "their end is cut off" if what == "truncated" else "they are skipped"
    warnings.warn(f"some instruction examples of {source.directory} do not fit a row (e.g. {example}): "
                  f"{consequence}; raise data.seq_len to keep them whole", stacklevel=3)


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


class SampleStream:
    """One reader's samples: several sources mixed by weight, the objective applied with a per-sample seed."""

    def __init__(self, spec: LoaderSpec, reader: int, state: dict | None) -> None:
        sources = spec.sources
        state = state or {"samples": 0, "positions": [Position().as_dict() for _ in sources]}
        self.opener = ShardOpener(spec.on_corrupt, list(state.get("skipped", [])))
        self.seed, self.salt, self.reader, self.samples = spec.seed, spec.salt, reader, state["samples"]
        self.objective = spec.objective
        self.weights = np.array([s.weight for s in sources]) / sum(s.weight for s in sources)
        n_readers = spec.dp_size * spec.workers_per_rank
        self.streams = [
            WindowStream(DocumentReader(s, spec.seed, reader, n_readers, spec.shuffle, spec.block, self.opener,
                                        spec.epochs), spec.objective, spec.eos, Position(**p))
            for s, p in zip(sources, state["positions"])
        ]

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            rng = _rng(self.seed, self.salt, self.reader, self.samples)
            choice = int(rng.choice(len(self.streams), p=self.weights)) if len(self.streams) > 1 else 0
            try:
                window = next(self.streams[choice])
            except StopIteration:  # a finite stream (validation) ends when its first source does
                return
            self.samples += 1
            yield self.objective.build(window, rng)

    def state(self) -> dict:
        return {"samples": self.samples, "positions": [s.position.as_dict() for s in self.streams],
                "skipped": list(self.opener.skipped)}


def collate(samples: list[dict[str, np.ndarray]]) -> dict[str, torch.Tensor]:
    return {key: torch.from_numpy(np.stack([s[key] for s in samples]).astype(np.int64)) for key in samples[0]}


# ------------------------------------------------------------------------------------------- loader


@dataclass
class LoaderSpec:
    sources: list[Source]
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

    @property
    def workers_per_rank(self) -> int:
        return max(1, self.num_workers)

    def reader_id(self, logical_worker: int) -> int:
        return self.dp_rank * self.workers_per_rank + logical_worker


class _Batches(IterableDataset):
    """Runs inside each DataLoader worker (or in the main process): batches tagged with reader states."""

    def __init__(self, spec: LoaderSpec, states: dict[int, dict], rotation: int) -> None:
        self.spec, self.states, self.rotation = spec, states, rotation

    def __iter__(self):
        spec = self.spec
        info = get_worker_info()
        logical = (info.id + self.rotation) % spec.workers_per_rank if info else 0
        reader = spec.reader_id(logical)
        stream = SampleStream(spec, reader, self.states.get(reader))
        samples = iter(stream)
        while True:
            batch = [s for _, s in zip(range(spec.micro_batch_size), samples)]
            if len(batch) < spec.micro_batch_size:
                return  # a finite (validation) stream drops its last partial batch
            yield collate(batch), reader, stream.state()


class StreamingLoader:
    """Iterate for batches (dicts of tensors); ``state_dict()`` after batch k resumes at batch k + 1.

    Train loaders are endless; a validation loader yields the same finite sequence of batches on every
    iteration (and on every rank).
    """

    def __init__(self, spec: LoaderSpec, model: ModelConfig | None = None) -> None:
        self.spec = spec
        self.states: dict[int, dict] = {}
        self.consumed = 0
        if model is not None:
            self.check_compatible(model)

    def check_compatible(self, model: ModelConfig) -> None:
        """Raise DataError when the shards' vocabulary does not fit the model's (also done at build time)."""
        for source in self.spec.sources:
            if source.manifest.vocab_size > model.vocab_size:
                raise DataError(f"{source.directory} holds token ids up to {source.manifest.vocab_size - 1} but "
                                f"model.vocab_size={model.vocab_size}; set model.vocab_size >= "
                                f"{source.manifest.vocab_size}")

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        spec = self.spec
        if not spec.shuffle:  # validation: the same batches, from the beginning, every time
            self.states, self.consumed = {}, 0
        rotation = self.consumed % spec.workers_per_rank
        dataset = _Batches(spec, dict(self.states), rotation)
        loader = DataLoader(dataset, batch_size=None, num_workers=spec.num_workers, persistent_workers=False)
        produced = 0
        for batch, reader, state in loader:
            self.states[reader] = state
            self.consumed += 1
            produced += 1
            yield batch
        if produced == 0 and not spec.shuffle:
            raise DataError(f"the {spec.sources[0].split} split of {spec.sources[0].directory} holds less than one "
                            f"batch of {spec.micro_batch_size} sequences; shard more validation documents "
                            "(--valid-every) or lower the batch size")

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "readers": {str(k): v for k, v in self.states.items()},
                "dp_rank": self.spec.dp_rank, "dp_size": self.spec.dp_size, "num_workers": self.spec.num_workers,
                "sources": [s.fingerprint for s in self.spec.sources]}

    def load_state_dict(self, state: dict) -> None:
        spec = self.spec
        layout = (state["dp_size"], state["num_workers"])
        if layout != (spec.dp_size, spec.num_workers):
            raise DataError(f"the data-loader state was saved with dp_size, num_workers = {layout}, this run has "
                            f"{(spec.dp_size, spec.num_workers)}; exact resume needs the same layout "
                            "(use init_from= to start a new run from the weights)")
        if state.get("dp_rank", spec.dp_rank) != spec.dp_rank:
            raise DataError(f"the data-loader state belongs to data-parallel rank {state['dp_rank']}, "
                            f"not to rank {spec.dp_rank}")
        fingerprints = [s.fingerprint for s in spec.sources]
        if state.get("sources", fingerprints) != fingerprints:
            raise DataError(f"data.{spec.sources[0].split} holds other shards than when the checkpoint was saved; "
                            "exact resume needs the same datasets (use init_from= to start a new run from the "
                            "weights)")
        self.consumed = state["consumed"]
        self.states = {int(k): v for k, v in state["readers"].items()}

    @property
    def skipped_shards(self) -> list[str]:
        """Corrupt shards skipped so far (data.on_corrupt=skip), for the metrics."""
        return sorted({s for state in self.states.values() for s in state.get("skipped", [])})

    def metrics(self) -> dict[str, float]:
        return {"data/skipped_shards": float(len(self.skipped_shards)),
                "data/epoch": float(max((p["epoch"] for st in self.states.values() for p in st["positions"]),
                                        default=0))}

    def tokens_per_epoch(self) -> int:
        """Tokens of one pass over the split (all sources), from the manifests."""
        return sum(s.manifest.tokens(s.split) for s in self.spec.sources)


def build_loader(cfg: RunConfig, split: str, micro_batch_size: int, dp_rank: int, dp_size: int,
                 tokenizer: TokenizerInfo, epochs: int | None = None) -> StreamingLoader:
    """The loader of ``split``: "train" is endless and shuffled, split over ``dp_size`` ranks x
    ``data.num_workers`` workers; "valid" is ``epochs`` (default 1) in-order passes, the same on every rank."""
    data = cfg.data
    if split not in SPLIT_SALT:
        raise DataError(f"split must be train or valid, got {split!r}")
    if not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank={dp_rank} is not in [0, dp_size={dp_size})")
    sources = resolve_sources(data.valid, "valid", fallback=data.train) if split == "valid" else \
        resolve_sources(data.train, "train")
    check_compatible(sources, tokenizer, cfg.model)
    check_instructions(sources, cfg)
    if data.on_corrupt == "error":  # a missing shard fails now, not hours into the run (checksums: when read)
        missing = [str(s.directory / i.file) for s in sources for i in s.shards if not (s.directory / i.file).is_file()]
        if missing:
            raise DataError(f"{len(missing)} shard(s) listed in the manifest are missing, e.g. {missing[0]} "
                            "(restore them, re-shard, or set data.on_corrupt=skip)")
    workers = data.num_workers if split == "train" else 0
    readers = dp_size * max(1, workers)
    fewest = min(len(s.shards) for s in sources)
    if split == "train" and fewest < readers:
        raise DataError(f"{fewest} train shards cannot feed {dp_size} ranks x {max(1, workers)} workers = {readers} "
                        "readers (each reader needs its own shard); write smaller shards (--shard-mb) or lower "
                        "data.num_workers")
    if split == "valid":  # validation shards are few: every rank reads all of them, in order
        dp_rank, dp_size, epochs = 0, 1, epochs or 1
    objective = build_objective(cfg.objective, cfg.model.arch, data.seq_len, data.pack, tokenizer,
                                cfg.objective_args)
    eos = tokenizer.require("eos", "document separation")
    spec = LoaderSpec(sources, objective, eos, cfg.seed, SPLIT_SALT[split], micro_batch_size, dp_rank, dp_size,
                      workers, split == "train", max(1, data.shuffle_buffer), data.on_corrupt, epochs)
    return StreamingLoader(spec, cfg.model)
