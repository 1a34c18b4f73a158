"""The streaming loader: shards -> documents -> windows -> objective samples -> batches, resumable exactly.

Who reads what. The data-parallel ranks times the DataLoader workers form ``n_readers`` readers. In epoch
``e`` the shards are permuted with ``(seed, e)`` and reader ``r`` reads shards ``r, r + n_readers, ...``;
inside a shard the documents are permuted with ``(seed, e, shard)``. So every reader's stream is a pure
function of the seed and its position: no shared state, no coordination.

Exact resume. A reader's position is ``{epoch, shard, doc, offset}`` (the next window starts ``offset``
tokens into that document) plus its sample counter; objectives seed their randomness per sample. Workers
send their position with every batch, the main process keeps the latest one per reader, and
``state_dict()`` is that small dict. Restarting from it, every reader continues where it stopped, and the
batch order across workers continues too (the worker that was next is mapped to DataLoader worker 0).

No hang. Training streams are endless (epochs roll over), so every rank can take the same number of steps;
validation takes a fixed number of batches (it restarts from the beginning when it runs out).
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline import DataError
from data_pipeline.objectives import Objective, Window, build_objective
from data_pipeline.shard import Manifest, ShardInfo, decode_ids, token_dtype
from data_pipeline.tokenizer import TokenizerInfo
from megatransformer.config import DatasetSource, RunConfig

SPLIT_SALT = {"train": 0, "valid": 1}


@dataclass
class Source:
    directory: Path
    split: str
    shards: list[ShardInfo]
    weight: float


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
            raise DataError(f"{entry.path} has no {split} shards (manifest lists {sorted(manifest.splits)})")
        sources.append(Source(Path(entry.path), split, shards, entry.weight))
    return sources


def check_compatible(sources: list[Source], tok: TokenizerInfo, vocab_size: int) -> None:
    """Shards, tokenizer and model must agree on the token ids; checked before any step is taken."""
    for source in sources:
        manifest = Manifest.load(source.directory)
        if manifest.tokenizer_sha256 != tok.sha256:
            raise DataError(f"{source.directory} was tokenized with another tokenizer than data.tokenizer="
                            f"{tok.path} (sha256 {manifest.tokenizer_sha256[:12]} vs {tok.sha256[:12]}); re-shard")
        if manifest.dtype != token_dtype(manifest.vocab_size).name:
            raise DataError(f"{source.directory}: dtype {manifest.dtype} cannot hold vocab {manifest.vocab_size}")
    if tok.vocab_size > vocab_size:
        raise DataError(f"tokenizer {tok.path} has {tok.vocab_size} tokens but model.vocab_size={vocab_size}; "
                        f"set model.vocab_size >= {tok.vocab_size}")


# ------------------------------------------------------------------------------------------- readers


@dataclass
class Position:
    epoch: int = 0
    shard: int = 0  # index into this reader's shard list of the epoch
    doc: int = 0  # index into the shard's (permuted) documents
    offset: int = 0  # tokens of that document already consumed

    def as_dict(self) -> dict:
        return {"epoch": self.epoch, "shard": self.shard, "doc": self.doc, "offset": self.offset}


@dataclass
class ShardCache:
    on_corrupt: str
    skipped: list[str] = field(default_factory=list)

    def read(self, source: Source, info: ShardInfo) -> list[np.ndarray] | None:
        """All documents of a shard, or None when it is corrupt and on_corrupt=skip."""
        import webdataset as wds

        path = source.directory / info.file
        try:
            data = path.read_bytes()
            if hashlib.sha256(data).hexdigest() != info.sha256:
                raise DataError("checksum differs from the manifest (truncated or modified)")
            pipeline = wds.WebDataset(str(path), shardshuffle=False, nodesplitter=_all, workersplitter=_all,
                                      empty_check=False)
            docs = [decode_ids(sample["ids.npy"]).astype(np.int64) for sample in pipeline]
            if len(docs) != info.samples:
                raise DataError(f"holds {len(docs)} samples, the manifest says {info.samples}")
        except Exception as err:  # tarfile, numpy and I/O errors all mean the same: this shard is unusable
            message = f"corrupt shard {path}: {err}"
            if self.on_corrupt == "error":
                raise DataError(message + " (set data.on_corrupt=skip to skip it)") from None
            warnings.warn(message + "; skipping it (data.on_corrupt=skip)")
            self.skipped.append(str(path))
            return None
        return docs


def _all(urls):
    return urls


def _rng(*key: int) -> np.random.Generator:
    return np.random.default_rng([k & 0xFFFFFFFF for k in key])


class DocumentReader:
    """The documents of one reader and one source, in the deterministic order described above."""

    def __init__(self, source: Source, seed: int, reader: int, n_readers: int, shuffle: bool,
                 cache: ShardCache, epochs: int | None) -> None:
        self.source, self.seed, self.reader, self.n_readers = source, seed, reader, n_readers
        self.shuffle, self.cache, self.epochs = shuffle, cache, epochs

    def shard_order(self, epoch: int) -> list[int]:
        order = np.arange(len(self.source.shards))
        if self.shuffle:
            order = _rng(self.seed, epoch).permutation(order)
        return [int(i) for i in order[self.reader::self.n_readers]]

    def documents(self, start: Position) -> Iterator[tuple[np.ndarray, Position]]:
        """Yield (document tokens, its Position) from ``start`` on (the first one from start.offset on)."""
        epoch, shard_pos, doc_pos = start.epoch, start.shard, start.doc
        while self.epochs is None or epoch < self.epochs:
            shards = self.shard_order(epoch)
            while shard_pos < len(shards):
                docs = self.cache.read(self.source, self.source.shards[shards[shard_pos]])
                if docs:
                    order = np.arange(len(docs))
                    if self.shuffle:
                        order = _rng(self.seed, epoch, shards[shard_pos]).permutation(order)
                    for d in range(doc_pos, len(docs)):
                        yield docs[order[d]], Position(epoch, shard_pos, d, 0)
                shard_pos, doc_pos = shard_pos + 1, 0
            if not self.cache.skipped or len(self.cache.skipped) < len(self.source.shards):
                epoch, shard_pos = epoch + 1, 0
            else:
                raise DataError(f"every shard of {self.source.directory} is corrupt")


class WindowStream:
    """Cuts a reader's documents into the objective's windows: packed across documents (EOS between them)
    or one document per row; consecutive windows of one document share ``overlap`` tokens."""

    def __init__(self, docs: DocumentReader, objective: Objective, eos: int, start: Position) -> None:
        self.docs, self.objective, self.eos = docs, objective, eos
        self.position = start  # where the next window starts
        self._iter = self._windows()

    def __next__(self) -> Window:
        return next(self._iter)

    def _pieces(self) -> Iterator[tuple[np.ndarray, Position]]:
        """Documents (with EOS appended) from the current position, the first cut at its offset."""
        first = True
        for tokens, pos in self.docs.documents(self.position):
            tokens = np.r_[tokens, self.eos]
            if first:
                pos = Position(pos.epoch, pos.shard, pos.doc, self.position.offset)
                first = False
            yield tokens, pos

    def _windows(self) -> Iterator[Window]:
        size, overlap = self.objective.window, self.objective.overlap
        if not self.objective.packed:
            yield from self._rows(size, overlap)
            return
        buf_tokens, buf_seg, buf_pos, buf_off = [], [], [], []  # per token: id, doc number, doc Position, offset
        n_docs = 0
        for tokens, pos in self._pieces():
            n_docs += 1
            count = len(tokens) - pos.offset
            buf_tokens.extend(tokens[pos.offset:].tolist())
            buf_seg.extend([n_docs] * count)
            buf_pos.extend([pos] * count)
            buf_off.extend(range(pos.offset, len(tokens)))
            while len(buf_tokens) >= size:
                stride = size - overlap
                window = Window(np.array(buf_tokens[:size]), _renumber(np.array(buf_seg[:size])))
                if len(buf_tokens) > stride:
                    p = buf_pos[stride]
                    self.position = Position(p.epoch, p.shard, p.doc, buf_off[stride])
                else:  # the next window starts with the next document
                    self.position = Position(pos.epoch, pos.shard, pos.doc + 1, 0)
                del buf_tokens[:stride], buf_seg[:stride], buf_pos[:stride], buf_off[:stride]
                yield window

    def _rows(self, size: int, overlap: int) -> Iterator[Window]:
        for tokens, pos in self._pieces():
            offset = pos.offset
            while len(tokens) - offset >= self.objective.min_tokens:
                chunk = tokens[offset:offset + size]
                end = offset + len(chunk)
                offset = end - overlap if end < len(tokens) else len(tokens)
                self.position = Position(pos.epoch, pos.shard, pos.doc, offset)
                yield Window(chunk, np.ones(len(chunk), dtype=np.int64))
            self.position = Position(pos.epoch, pos.shard, pos.doc + 1, 0)


def _renumber(segments: np.ndarray) -> np.ndarray:
    return np.r_[1, 1 + np.cumsum(segments[1:] != segments[:-1])]


class SampleStream:
    """One reader's samples: several sources mixed by weight, the objective applied with a per-sample seed."""

    def __init__(self, sources: list[Source], objective: Objective, eos: int, seed: int, salt: int,
                 reader: int, n_readers: int, shuffle: bool, on_corrupt: str, epochs: int | None,
                 state: dict | None) -> None:
        state = state or {"samples": 0, "positions": [Position().as_dict() for _ in sources]}
        self.cache = ShardCache(on_corrupt, list(state.get("skipped", [])))
        self.seed, self.salt, self.reader, self.samples = seed, salt, reader, state["samples"]
        self.objective = objective
        self.weights = np.array([s.weight for s in sources]) / sum(s.weight for s in sources)
        self.streams = [
            WindowStream(DocumentReader(s, seed, reader, n_readers, shuffle, self.cache, epochs), objective, eos,
                         Position(**p))
            for s, p in zip(sources, state["positions"])
        ]

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        while True:
            rng = _rng(self.seed, self.salt, self.reader, self.samples)
            choice = int(rng.choice(len(self.streams), p=self.weights)) if len(self.streams) > 1 else 0
            try:
                window = next(self.streams[choice])
            except StopIteration:
                return
            self.samples += 1
            yield self.objective.build(window, rng)

    def state(self) -> dict:
        return {"samples": self.samples, "positions": [s.position.as_dict() for s in self.streams],
                "skipped": list(self.cache.skipped)}


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
        stream = SampleStream(spec.sources, spec.objective, spec.eos, spec.seed, spec.salt, reader,
                              spec.dp_size * spec.workers_per_rank, spec.shuffle, spec.on_corrupt, spec.epochs,
                              self.states.get(reader))
        samples = iter(stream)
        while True:
            batch = [s for _, s in zip(range(spec.micro_batch_size), samples)]
            if len(batch) < spec.micro_batch_size:
                return  # a finite (validation) stream drops its last partial batch
            yield collate(batch), reader, stream.state()


class StreamingLoader:
    """Iterate for batches (dicts of tensors); ``state_dict()`` after batch k resumes at batch k + 1."""

    def __init__(self, spec: LoaderSpec) -> None:
        self.spec = spec
        self.states: dict[int, dict] = {}
        self.consumed = 0

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        spec = self.spec
        if not spec.shuffle:  # validation: the same batches, from the beginning, every time
            self.states, self.consumed = {}, 0
        rotation = self.consumed % spec.workers_per_rank
        dataset = _Batches(spec, dict(self.states), rotation)
        loader = DataLoader(dataset, batch_size=None, num_workers=spec.num_workers,
                            persistent_workers=False, multiprocessing_context="fork" if spec.num_workers else None)
        for batch, reader, state in loader:
            self.states[reader] = state
            self.consumed += 1
            yield batch

    def state_dict(self) -> dict:
        return {"consumed": self.consumed, "readers": {str(k): v for k, v in self.states.items()},
                "dp_size": self.spec.dp_size, "num_workers": self.spec.num_workers}

    def load_state_dict(self, state: dict) -> None:
        layout = (state["dp_size"], state["num_workers"])
        if layout != (self.spec.dp_size, self.spec.num_workers):
            raise DataError(f"the data-loader state was saved with dp_size, num_workers = {layout}, this run has "
                            f"{(self.spec.dp_size, self.spec.num_workers)}; exact resume needs the same layout "
                            "(use init_from= to start a new run from the weights)")
        self.consumed = state["consumed"]
        self.states = {int(k): v for k, v in state["readers"].items()}

    @property
    def skipped_shards(self) -> list[str]:
        return sorted({s for state in self.states.values() for s in state.get("skipped", [])})


def build_loader(cfg: RunConfig, split: str, micro_batch_size: int, dp_rank: int, dp_size: int,
                 tokenizer: TokenizerInfo, epochs: int | None = None) -> StreamingLoader:
    """The loader of ``split`` ("train": endless, shuffled; "valid": in order, ``epochs`` passes or endless)."""
    data = cfg.data
    if split == "train":
        sources = resolve_sources(data.train, "train")
    else:
        sources = resolve_sources(data.valid, "valid", fallback=data.train)
    check_compatible(sources, tokenizer, cfg.model.vocab_size)
    readers = dp_size * max(1, data.num_workers)
    fewest = min(len(s.shards) for s in sources)
    if split == "train" and fewest < readers:
        raise DataError(f"{fewest} {split} shards cannot feed {dp_size} ranks x {max(1, data.num_workers)} workers "
                        f"= {readers} readers; write smaller shards (--shard-mb) or lower data.num_workers")
    if split == "valid":  # few validation shards: every rank reads all of them, in order
        dp_rank, dp_size = 0, 1
    objective = build_objective(cfg.objective, cfg.model.arch, data.seq_len, data.pack, tokenizer,
                                cfg.objective_args)
    eos = tokenizer.require("eos", "document separation")
    spec = LoaderSpec(sources, objective, eos, cfg.seed, SPLIT_SALT[split], micro_batch_size, dp_rank, dp_size,
                      data.num_workers if split == "train" else 0, split == "train", data.on_corrupt, epochs)
    return StreamingLoader(spec)
