"""The streaming loader: rows from the workers' streams in the global order, batches, skipped rows, resume."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data_pipeline import DataError
from data_pipeline.loader.blocks import ShardOpener
from data_pipeline.loader.sources import check_compatible, check_instructions, check_streams, resolve_datasets
from data_pipeline.loader.spec import SPLIT_SALT, LoaderSettings, LoaderSpec
from data_pipeline.loader.state import STATE_FORMAT, check_counts, check_format, merge_states, merged_ranges
from data_pipeline.loader.windows import StreamSamples, collate
from data_pipeline.objectives import build_objective
from data_pipeline.remote import Retry
from data_pipeline.tokenizer import TokenizerInfo


def _stack(rows: list[torch.Tensor], pin_memory: bool) -> torch.Tensor:
    """Rows into one batch tensor, written straight into page-locked memory when asked."""
    if not pin_memory:
        return torch.stack(rows)
    out = torch.empty((len(rows), *rows[0].shape), dtype=rows[0].dtype, pin_memory=True)
    return torch.stack(rows, out=out)


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
        self.skip = merged_ranges([*self.skip, (start // unit * unit, -(-stop // unit) * unit)])

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
        check_format(state)
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
            check_counts(streams, spec.dp_rank, spec.dp_size, rows, spec.streams)
        elif state["dp_size"] == 1:  # the whole sequence: take this rank's share of it
            total = state["rows"]
            if total % spec.dp_size:
                raise DataError(
                    f"the data-loader state is at global row {total}, which {spec.dp_size} "
                    "data-parallel ranks cannot split evenly; keep the global batch size a multiple "
                    "of the data-parallel size"
                )
            check_counts(streams, 0, 1, total, spec.streams)
            rows = total // spec.dp_size
            streams = {k: v for k, v in streams.items() if k % spec.dp_size == spec.dp_rank}
        else:
            raise DataError(
                f"the data-loader state belongs to data-parallel rank {state['dp_rank']} of "
                f"{state['dp_size']}, not to rank {spec.dp_rank} of {spec.dp_size}; load the states "
                "of all ranks (merge_states) to resume on another layout"
            )
        self.rows, self.stream_states, self.skipped = rows, streams, list(state["skipped"])
        self.skip = merged_ranges(tuple(r) for r in state.get("skip_rows", []))

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


def check_data(settings: LoaderSettings, tokenizer: TokenizerInfo, dp_size: int = 1) -> None:
    """The checks a loader makes when built, of both splits, from the manifests alone (the train split's streams
    dealt to ``dp_size`` data-parallel ranks included): a run can make them before its engines start."""
    data = settings.data
    retry = Retry(data.retries, settings.retry_wait)
    train = resolve_datasets(data.train, "train", retry)
    check_streams(train, data.streams, dp_size, data.num_workers)
    shard_sets = train + resolve_datasets(data.valid, "valid", retry, fallback=data.train)
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
