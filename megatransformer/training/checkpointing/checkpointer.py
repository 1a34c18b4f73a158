"""The run's state in and out of the DeepSpeed engine: each rank's own part of the weights (fp32 masters where
they exist) and optimizer state, found through the engine's partition map, saved once (sharded, in the
background) and loaded on any layout. The directory format is ``megatransformer.checkpoint``'s;
docs/checkpoints.md."""

from __future__ import annotations

import functools
import importlib
import io
import json
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from data_pipeline import WriteFailed, free_space, write_reason
from megatransformer import checkpoint as ckpt
from megatransformer.checkpoint import sharded
from megatransformer.config import RunConfig, dump_config
from megatransformer.model.tp_plan import partition_dim
from megatransformer.training.checkpointing.rng import rng_state, set_rng_state
from megatransformer.training.deepspeed.masters import fragment_master, fragment_state, weights_from_masters
from megatransformer.training.deepspeed.partitions import Fragment as MapFragment
from megatransformer.training.deepspeed.partitions import PartitionMap


@functools.cache
def deepspeed_safe_globals() -> list[type]:
    """The classes :data:`ckpt.DEEPSPEED_STATE_GLOBALS` names, which weights_only loads of DeepSpeed's states
    (and of our per-rank states) allow, for the duration of those loads only."""
    classes = []
    for name in ckpt.DEEPSPEED_STATE_GLOBALS:
        module, _, attribute = name.rpartition(".")
        classes.append(getattr(importlib.import_module(module), attribute))
    return classes


def innermost_optimizer(engine) -> torch.optim.Optimizer:
    """The torch optimizer inside DeepSpeed's ZeRO and bf16 wrappers (each keeps the next in ``.optimizer``):
    the one whose ``step`` changes state."""
    inner = engine.optimizer
    while hasattr(inner, "optimizer"):
        inner = inner.optimizer
    return inner


# ------------------------------------------------------------------------------------ fragments


@dataclass
class Fragment:
    """The part of one parameter's fp32 state this rank holds: flat elements [start, stop) of its
    tensor-parallel slice ``tp_index``; ``view(kind)`` is the live tensor of those elements (``sharded.MASTER``:
    the fp32 weights; else an optimizer state key)."""

    name: str
    tp_index: int
    start: int
    stop: int
    view: Callable[[str], torch.Tensor] = field(repr=False)

    @property
    def coordinates(self) -> tuple[str, int, int, int]:
        return self.name, self.tp_index, self.start, self.stop


def param_layouts(engine, partitions: PartitionMap, tp: int) -> dict[str, tuple[tuple[int, ...], int | None]]:
    """Every parameter's global shape and the dimension tensor parallelism splits (None: not split)."""
    layouts = {}
    for name, _ in engine.module.named_parameters():
        dim = partition_dim(name) if tp > 1 else None
        shape = list(partitions.shapes[name])
        if dim is not None:
            shape[dim] *= tp
        layouts[name] = (tuple(shape), dim)
    return layouts


def local_fragments(engine, partitions: PartitionMap, tp: int) -> list[Fragment]:
    """This rank's fragment of every parameter it holds state for, in the model's order, as the partition map
    places it in the buffers the torch optimizer steps: ZeRO-3's and ZeRO-1/2's fp32 partitions, the bf16
    optimizer's, ZeRO-0's fp16/bf16 masters, or (ZeRO-0 fp32) the parameters themselves. Ranks that hold the same
    elements (ZeRO-0, or the replicas of a ZeRO group) each report them; :class:`SavePlan` divides them."""
    inner = innermost_optimizer(engine)
    order = {name: i for i, (name, _) in enumerate(engine.module.named_parameters())}
    return [
        Fragment(f.name, tp_slice(f, tp), f.start, f.start + f.numel, functools.partial(_view, partitions, f, inner))
        for f in sorted(partitions.mine(), key=lambda f: order[f.name])
    ]


def tp_slice(placed: MapFragment, tp: int) -> int:
    """The tensor-parallel slice a fragment of the map is of: its rank's, or 0 where tensor parallelism does not
    split the parameter (every tensor-parallel rank holds the same elements)."""
    return placed.tp_rank if tp > 1 and partition_dim(placed.name) is not None else 0


def _view(
    partitions: PartitionMap, placed: MapFragment, inner: torch.optim.Optimizer, kind: str
) -> torch.Tensor | None:
    """(None: the optimizer keeps no state ``kind`` for this parameter, as Muon keeps no Adam moments.)"""
    if kind == sharded.MASTER:
        return fragment_master(partitions, placed)
    return fragment_state(partitions, placed, inner, kind)


def optimizer_state_keys(engine) -> list[str]:
    """The optimizer's per-element state keys (Adam's two moments, a momentum buffer, ...): the tensors of its
    state that are not scalars (a step count is one); none before its first step."""
    inner = innermost_optimizer(engine)
    keys: set[str] = set()
    for state in inner.state.values():
        keys.update(k for k, v in state.items() if torch.is_tensor(v) and v.dim() > 0)
    return sorted(keys)


def _adam_step(inner: torch.optim.Optimizer) -> int:
    return int(max((float(s["step"]) for s in inner.state.values() if "step" in s), default=0))


# ------------------------------------------------------------------------------------ saving


@dataclass
class SavePlan:
    """Who writes what, the same at every save of a run: each element of each parameter's state is written by
    exactly one rank (ranks holding the same elements split them evenly), and the index every save carries."""

    mine: list[tuple[Fragment, int, int]]  # (fragment, start, stop): the elements this rank writes
    held: list[Fragment]  # every fragment this rank holds
    index: dict[str, sharded.ParamLayout] | None  # on rank 0
    aliases: dict[str, str]

    @classmethod
    def build(cls, engine, partitions: PartitionMap, tp: int) -> SavePlan:
        """From the partition map, which holds every rank's fragments: no collective."""
        fragments = local_fragments(engine, partitions, tp)
        holders: dict[tuple[str, int, int, int], list[int]] = {}
        for placed in partitions.fragments:
            coordinates = placed.name, tp_slice(placed, tp), placed.start, placed.start + placed.numel
            holders.setdefault(coordinates, []).append(placed.rank)
        rank = partitions.rank
        mine = []
        for f in fragments:
            ranks = holders[f.coordinates]
            lo, hi = _share(f.start, f.stop, ranks.index(rank), len(ranks))
            if lo < hi:
                mine.append((f, lo, hi))
        index = None
        if rank == 0:
            pieces: dict[str, list[sharded.Piece]] = {}
            for (name, tp_index, start, stop), ranks in holders.items():
                for i, r in enumerate(ranks):
                    lo, hi = _share(start, stop, i, len(ranks))
                    if lo < hi:
                        pieces.setdefault(name, []).append(sharded.Piece(tp_index, lo, hi, sharded.shard_file(r)))
            index = {}
            for name, (shape, dim) in param_layouts(engine, partitions, tp).items():
                layout = sharded.ParamLayout(
                    shape, dim, tp if dim is not None else 1, tuple(sorted(pieces.get(name, []), key=_order))
                )
                sharded.check_cover(name, layout)
                index[name] = layout
        return cls(mine, fragments, index, tied_names(engine.module))


def partial_kinds(fragments: list[Fragment], kinds: list[str]) -> dict[str, list[str]]:
    """The kinds of state each parameter in ``fragments`` has, for those that lack some of ``kinds``: an optimizer
    may keep other state for some parameters (Muon's matrices a momentum, the others Adam's moments)."""
    partial = {}
    for fragment in fragments:
        have = [kind for kind in kinds if fragment.view(kind) is not None]
        if len(have) < len(kinds):
            partial[fragment.name] = have
    return partial


def _order(piece: sharded.Piece) -> tuple[int, int]:
    return piece.tp_index, piece.start


def _share(start: int, stop: int, i: int, k: int) -> tuple[int, int]:
    """Part ``i`` of ``k`` near-equal parts of [start, stop)."""
    n = stop - start
    return start + n * i // k, start + n * (i + 1) // k


def tied_names(module: torch.nn.Module) -> dict[str, str]:
    """Names of the module's state that are another name of a parameter (tied weights), to that parameter's
    name; a buffer in the state would not be saved, so there must be none."""
    first = {id(p): name for name, p in module.named_parameters()}
    aliases = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) not in first:
            raise ValueError(f"{name}: a buffer in the model's state, which checkpoints do not hold")
        if first[id(tensor)] != name:
            aliases[name] = first[id(tensor)]
    return aliases


@dataclass
class SaveJob:
    """One save, once its state is on the host: what the background writer writes."""

    path: Path
    step: int
    save: str  # the save's id: every shard records it, a shard of another save is refused
    tensors: dict[str, torch.Tensor]  # this rank's shard
    rank_state: bytes  # rank_NNNNN.pt: loader and RNG state
    files: dict[str, bytes]  # rank 0: trainer.json, config.yaml, tokenizer.json, index.json
    keep: Collection[str]
    stall_s: float
    setup_s: float  # of the stall: the writers' group, the save plan and host memory, made by a run's first save


@dataclass
class SaveOutcome:
    """A finished save, as every rank learns it."""

    path: Path
    step: int
    stall_s: float
    setup_s: float
    write_s: float
    bytes: int
    error: str | None  # the WriteFailed line, when a rank's write failed


STAGING_BLOCK_BYTES = 1 << 30


class StagingBlocks:
    """Host memory for a rank's pieces of state, kept from save to save: a buffer each in pageable memory; where
    pinned (CUDA), fp32 views into blocks of
    :data:`STAGING_BLOCK_BYTES` (or, for a larger piece, the next power of two), each piece whole in one, the pieces in
    turn; pinned on CUDA, whose allocator rounds every pinned allocation up to a power of two: a buffer a piece
    would have taken 1.4x the pieces' bytes on average and up to 2x, unswappable; the blocks lose a block's tail to
    a piece that does not fit, and the last block's rounding."""

    def __init__(self, pinned: bool) -> None:
        self.pinned = pinned
        self.sizes: list[int] = []
        self.blocks: list[torch.Tensor] = []
        self.pieces: list[torch.Tensor] = []

    def views(self, sizes: list[int]) -> list[torch.Tensor]:
        """A view of ``sizes[i]`` elements for each piece, the same views as long as the sizes are."""
        if sizes != self.sizes:
            self.blocks = self.pieces = []  # (the last save's blocks freed before the new ones are made)
            self.sizes, (self.blocks, self.pieces) = list(sizes), self._laid_out(sizes)
        return self.pieces

    def _laid_out(self, sizes: list[int]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not self.pinned:  # (nothing rounds pageable memory; one large block would not fit the heap's holes)
            pieces = [torch.empty(size, dtype=torch.float32) for size in sizes]
            return pieces, pieces
        block = max([STAGING_BLOCK_BYTES // 4, *(1 << (size - 1).bit_length() for size in sizes if size)])
        fills: list[int] = []  # (the elements each block holds)
        places = []  # (block, offset) of each piece
        for size in sizes:
            if not fills or fills[-1] + size > block:
                fills.append(0)
            places.append((len(fills) - 1, fills[-1]))
            fills[-1] += size
        blocks = [torch.empty(fill, dtype=torch.float32, pin_memory=self.pinned) for fill in fills]
        return blocks, [blocks[b][at : at + size] for (b, at), size in zip(places, sizes)]


class Checkpointer:
    """Saves and loads one run's state. ``save`` copies this rank's state to host memory (pinned on CUDA) and
    returns; a background thread writes the files, hashing them as they go out, and the ranks then agree (over
    a gloo group of the checkpointer's own) on the outcome: rank 0 writes the manifest (COMPLETE) and `latest`
    last, or removes the checkpoint when any rank's write failed. :meth:`wait` waits for the write in flight
    and raises its failure; the next save, a load, a rollback and the end of the run call it."""

    def __init__(self, engine, partitions: PartitionMap, cfg: RunConfig, device: torch.device) -> None:
        self.engine, self.partitions, self.cfg, self.device = engine, partitions, cfg, device
        self.tp = cfg.parallel.tensor_parallel
        self.plan: SavePlan | None = None
        self.group = None  # the background thread's process group (gloo), never the training's
        self.thread: threading.Thread | None = None
        self.outcome: SaveOutcome | None = None
        self.staging = StagingBlocks(pinned=device.type == "cuda")  # the pieces' host copies, from save to save
        self.done: list[SaveOutcome] = []  # finished saves not yet reported
        self.failure: str | None = None  # a failed write's line, raised at the next wait
        self.writer_error: BaseException | None = None  # the writer thread's own error, raised at the next wait
        self.writing: Path | None = None  # the checkpoint the thread in flight writes

    # -------------------------------------------------------------------------------- save

    def save(self, state: ckpt.TrainerState, loader_state: dict, keep: Collection[str] = ()) -> Path:
        """Start writing step ``state.step``'s checkpoint; returns its path (complete once the write is done).
        A collective: every rank calls it."""
        self.wait()
        began = time.perf_counter()
        if self.group is None:
            self.group = writer_group(self.cfg.checkpoint.timeout_minutes)
        if self.plan is None:
            self.plan = SavePlan.build(self.engine, self.partitions, self.tp)
        setup_s = time.perf_counter() - began
        root = ckpt.checkpoints_dir(self.cfg.run_dir)
        path = root / ckpt.step_name(state.step)
        rank = dist.get_rank()
        if rank == 0 and path.exists():  # a leftover of a run killed while saving this step (the broadcast
            shutil.rmtree(path)  # below keeps every writer behind its removal)
        box = [secrets.token_hex(16) if rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        kinds = [sharded.MASTER, *optimizer_state_keys(self.engine)]
        tensors, allocate_s = self._stage(kinds)
        buffer = io.BytesIO()
        torch.save({"loader": loader_state, "rng": rng_state()}, buffer)
        files: dict[str, bytes] = {}
        # (ZeRO 1-3: the ranks hold different parameters, so each says which kinds its parameters have)
        everyone: list[dict[str, list[str]] | None] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, partial_kinds(self.plan.held, kinds))
        if rank == 0:
            param_kinds = {name: have for partial in everyone for name, have in partial.items()}
            index = sharded.index_record(self.plan.index, kinds, self.plan.aliases, box[0], state.step, param_kinds)
            index["optimizer"] = self._optimizer_record()
            files[sharded.INDEX] = json.dumps(index).encode()
            files[ckpt.TRAINER_STATE] = json.dumps(state.model_dump(), indent=2).encode()
            files[ckpt.CONFIG] = dump_config(self.cfg).encode()
            if self.cfg.data.tokenizer:
                files[ckpt.TOKENIZER] = Path(self.cfg.data.tokenizer).read_bytes()
        job = SaveJob(path, state.step, box[0], tensors, buffer.getvalue(), files, keep, stall_s=0.0, setup_s=0.0)
        job.stall_s, job.setup_s = time.perf_counter() - began, setup_s + allocate_s
        self.writing = path
        self.thread = threading.Thread(target=self._write, args=(job,), name="checkpoint-writer", daemon=True)
        self.thread.start()
        return path

    def _stage(self, kinds: list[str]) -> tuple[dict[str, torch.Tensor], float]:
        """This rank's pieces of every kind of state its parameters have, copied to host memory (the step may go
        on changing the live tensors once this returns), and the seconds that memory took to allocate (none
        after the first save: the same blocks serve every save of the run)."""
        cuda = self.device.type == "cuda"
        with torch.no_grad():
            live = {}
            for fragment, lo, hi in self.plan.mine:
                for kind in kinds:
                    state = fragment.view(kind)
                    if state is not None:
                        key = sharded.piece_key(kind, fragment.name, fragment.tp_index, lo)
                        live[key] = state.reshape(-1)[lo - fragment.start : hi - fragment.start]
            allocating = time.perf_counter()
            hosts = self.staging.views([piece.numel() for piece in live.values()])
            allocate_s = time.perf_counter() - allocating
            for piece, host in zip(live.values(), hosts):
                host.copy_(piece, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize(self.device)
        return dict(zip(live, hosts)), allocate_s

    def _optimizer_record(self) -> dict[str, Any]:
        """The optimizer's step count, the LR scheduler's state and the fp16 loss scaler's numbers."""
        scheduler = self.engine.lr_scheduler.state_dict() if self.engine.lr_scheduler is not None else None
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        numbers = (
            {k: v for k, v in vars(scaler).items() if isinstance(v, (int, float, bool)) and not isinstance(v, type)}
            if scaler is not None
            else None
        )
        return {"step": _adam_step(innermost_optimizer(self.engine)), "lr_scheduler": scheduler, "loss_scaler": numbers}

    def _write(self, job: SaveJob) -> None:
        """The background thread: :meth:`_write_job`; its error (a collective of the writers' group that failed
        for want of another rank) is kept for :meth:`wait` to raise in the main thread, where it ends the run in
        one line, never a thread's traceback on stderr."""
        try:
            self._write_job(job)
        except BaseException as err:  # noqa: BLE001 (raised again by _collect)
            self.writer_error = err

    def _write_job(self, job: SaveJob) -> None:
        """The background writer: this rank's files, then the ranks' agreement, then (rank 0) the manifest."""
        from safetensors import SafetensorError

        began = time.perf_counter()
        rank = dist.get_rank()
        entries: dict[str, dict[str, Any]] = {}
        failed: tuple[str, str] | None = None
        outputs: list[tuple[str, Callable[[Path], dict[str, Any]]]] = [
            (
                sharded.shard_file(rank),
                lambda p: sharded.write_safetensors(p, job.tensors, {"save": job.save, "step": str(job.step)}),
            ),
            (ckpt.rank_file(rank), lambda p: sharded.write_file(p, job.rank_state)),
            *((name, functools.partial(sharded.write_file, data=data)) for name, data in job.files.items()),
        ]
        try:
            job.path.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            failed = (job.path.name, write_reason(err))
        for name, write in outputs:
            if failed is not None:
                break
            try:
                entries[name] = write(job.path / name)
            except (OSError, SafetensorError) as err:
                failed = (name, write_reason(err))
            except Exception as err:  # (still agreed on with the other ranks: none is left waiting)
                failed = (name, f"{err.__class__.__name__}: {str(err)[:200]}")
        reports: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(reports, (entries, failed), group=self.group)
        failure = next(((r, f) for r, (_, f) in enumerate(reports) if f is not None), None)
        total = sum(e["size"] for entries_, _ in reports for e in entries_.values())
        verdict: list[Any] = [None]
        if rank == 0:
            try:
                verdict[0] = self._finish(job, reports, failure)
            except Exception as err:  # (the other ranks wait for the verdict)
                verdict[0] = f"writing checkpoint {job.path.name} failed: {err.__class__.__name__}: {str(err)[:200]}"
        dist.broadcast_object_list(verdict, src=0, group=self.group)
        self.outcome = SaveOutcome(
            job.path, job.step, job.stall_s, job.setup_s, time.perf_counter() - began, total, verdict[0]
        )

    def _finish(self, job: SaveJob, reports: list[Any], failure: tuple[int, tuple[str, str]] | None) -> str | None:
        """Rank 0: the manifest and `latest` (last), and the rotation; or, after a failed write anywhere, the
        checkpoint removed. The failure line, or None."""
        root = job.path.parent
        if failure is None:
            entries = {name: e for entries_, _ in reports for name, e in entries_.items()}
            try:
                ckpt.write_manifest(job.path, entries)
                ckpt.atomic_write(root / ckpt.LATEST, job.path.name)
            except OSError as err:
                failure = (0, (ckpt.COMPLETE, write_reason(err)))
            else:
                ckpt.prune(root, self.cfg.checkpoint.keep, keep={job.path.name, *job.keep})
                return None
        shutil.rmtree(job.path, ignore_errors=True)  # (nothing half-written stays; `latest` names the last)
        last = ckpt.latest_checkpoint(root)
        intact = (
            f"the last intact checkpoint is {last.name} (resume=auto continues from it)"
            if last is not None
            else "no checkpoint of this run is complete yet"
        )
        rank, (name, reason) = failure
        where = f" on rank {rank}" if len(reports) > 1 else ""
        return f"writing checkpoint {job.path.name} failed{where} ({name}): {reason} ({free_space(root)}); {intact}"

    def wait(self) -> None:
        """Wait for the write in flight, if any; raise :class:`WriteFailed` (on every rank) when a write failed.
        A point every rank reaches (a save, a load, a rollback, the end of the run): the ranks fail together."""
        self._collect()
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise WriteFailed(failure)

    def finished(self) -> list[SaveOutcome]:
        """Saves finished since the last call (the one in flight too, once its writer is done): for the log. A
        failure is kept for :meth:`wait` (the writers of the ranks end at slightly different times)."""
        if self.thread is not None and not self.thread.is_alive():
            self._collect()
        done, self.done = self.done, []
        return done

    def _collect(self) -> None:
        if self.thread is None:
            return
        self.thread.join()
        self.thread, outcome, self.outcome = None, self.outcome, None
        error, self.writer_error = self.writer_error, None
        if error is not None and "timed out" in str(error).lower():
            minutes = self.cfg.checkpoint.timeout_minutes
            raise WriteFailed(
                f"writing checkpoint {self.writing.name} failed: the ranks' writers "
                f"did not all finish within checkpoint.timeout_minutes={minutes:g} (a slow or stalled rank, a slow "
                "file system); the last complete checkpoint is intact (resume=auto continues from it); raise "
                "checkpoint.timeout_minutes if the storage is slow"
            ) from None
        if error is not None:  # (the writer's own error, its frames kept: a lost peer reads as one line)
            raise error
        if outcome is None:
            raise RuntimeError("the checkpoint writer thread ended without an outcome")
        self.done.append(outcome)
        self.failure = outcome.error

    def finish(self, log: Callable[[str], None]) -> None:
        """On a run's way out after an error: wait for the write in flight, if any, at most the writers' group's
        timeout (checkpoint.timeout_minutes: past it the writers' collective fails anyway), and ``log`` a line
        before and after: a save that was started is completed, or said to be lost. Never raises."""
        thread = self.thread
        if thread is None:
            return
        name = self.writing.name if self.writing is not None else "?"
        minutes = self.cfg.checkpoint.timeout_minutes
        if thread.is_alive():
            log(f"waiting for checkpoint {name}, written in the background, before exiting (at most {minutes:g} min)")
            thread.join(60 * minutes + 30)
        if thread.is_alive():
            log(f"checkpoint {name} was not written within {minutes:g} min: exiting without it")
            return
        try:
            self._collect()
        except BaseException as err:  # noqa: BLE001 (the run is ending with an error of its own)
            line = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
            log(f"checkpoint {name} was not written: {line[:300]}")
            return
        if self.failure is not None:
            log(self.failure)
            self.failure = None
            return
        log(f"checkpoint {name} complete")

    # -------------------------------------------------------------------------------- load

    def load(self, path: Path, saved_world_size: int, same_layout: bool) -> dict | list[dict]:
        """Put this rank's part of checkpoint ``path``'s state into the engine (built from its weights), with
        the optimizer's step count, the LR schedule and the loss scale. On the layout that wrote it, returns this
        rank's loader state and restores its RNG; on another, returns the loader states of all ranks that wrote
        it (the loader merges them into the global row position) and restores rank 0's RNG (every rank draws
        the same numbers)."""
        self.wait()
        ranks = [dist.get_rank()] if same_layout else range(saved_world_size)
        layouts = param_layouts(self.engine, self.partitions, self.tp)

        def where(fragment: Fragment) -> tuple[int, int, int | None, int, int]:
            return fragment.tp_index, self.tp, layouts[fragment.name][1], fragment.start, fragment.stop

        fragments = local_fragments(self.engine, self.partitions, self.tp)

        def check() -> tuple[sharded.ShardedState, list[dict], dict[str, Any]]:
            """Everything this rank will read, checked before any of it is loaded."""
            state = sharded.ShardedState(path)
            for name, (shape, _) in layouts.items():
                saved_shape = state.params[name].shape if name in state.params else None
                if saved_shape != shape:
                    had = f"shape {list(saved_shape)}" if saved_shape is not None else "no such parameter"
                    raise ckpt.CheckpointDamaged(path, sharded.INDEX, f"{name}: {had}, the model's is {list(shape)}")
            reads = {ckpt.rank_file(r) for r in ranks}
            for fragment in fragments:
                reads |= state.files_of(fragment.name, *where(fragment))
            ckpt.verify_files(path, reads)
            state.check_shards(reads)  # (a shard of another save, under a manifest made to match)
            saved = [ckpt.safe_load(path / ckpt.rank_file(r), allowed=deepspeed_safe_globals()) for r in ranks]
            try:
                record = json.loads((path / sharded.INDEX).read_bytes())["optimizer"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise ckpt.CheckpointDamaged(path, sharded.INDEX, f"unreadable ({err.__class__.__name__})") from None
            return state, saved, record

        # (before the engine changes, and agreed: every rank loads, or every rank refuses with the same error)
        state, saved, record = ckpt.agreed(check)
        keys = [k for k in state.kinds if k != sharded.MASTER]
        inner = innermost_optimizer(self.engine)
        if keys:
            _ensure_state(self.partitions, inner, state, record["step"])
        with torch.no_grad():
            for fragment in fragments:
                for kind in state.kinds_of(fragment.name):
                    view = fragment.view(kind)
                    view.copy_(state.slice_of(fragment.name, kind, *where(fragment)).to(view.device))
        weights_from_masters(self.engine, self.partitions)
        scheduler = record["lr_scheduler"]
        if self.engine.lr_scheduler is not None and scheduler is not None:
            load_schedule(self.engine.lr_scheduler, scheduler)
        scaler = getattr(self.engine.optimizer, "loss_scaler", None)
        if scaler is not None and record.get("loss_scaler"):
            for k, v in record["loss_scaler"].items():
                setattr(scaler, k, v)
        set_rng_state(saved[0]["rng"])
        return saved[0]["loader"] if same_layout else [r["loader"] for r in saved]


def writer_group(minutes: float):
    """The background writers' own gloo group (never the training's, whose collectives the main thread keeps
    issuing), with its own timeout (checkpoint.timeout_minutes): a slow rank's write or rank 0's removal of old
    checkpoints on a network file system may take longer than a training collective should wait."""
    return dist.new_group(backend="gloo", timeout=timedelta(minutes=minutes))


def load_weights_into(model: torch.nn.Module, weights) -> None:
    """Copy ``weights`` (a mapping of the model's state names to tensors, perhaps assembled on lookup) into
    ``model`` one tensor at a time; a missing or an extra name is an error."""
    state = model.state_dict(keep_vars=True)
    missing, extra = sorted(set(state) - set(weights)), sorted(set(weights) - set(state))
    if missing or extra:
        raise ValueError(f"the weights do not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    done = set()
    with torch.no_grad():
        for name, tensor in state.items():
            if id(tensor) not in done:
                tensor.copy_(weights[name])
                done.add(id(tensor))


def load_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR, saved: dict[str, Any]) -> None:
    """Restore ``scheduler``'s place in the schedule from its ``saved`` state, then its rates
    (:func:`apply_schedule`). The per-group rates stay this run's where the optimizer's groups differ from the
    saved run's: Muon's matrices form one group per tensor-parallel split dimension."""
    saved = dict(saved)
    if len(saved.get("base_lrs", [])) != len(scheduler.optimizer.param_groups):
        saved.pop("base_lrs", None)
        saved.pop("_last_lr", None)
    scheduler.load_state_dict(saved)
    apply_schedule(scheduler)


def apply_schedule(scheduler: torch.optim.lr_scheduler.LambdaLR | None) -> None:
    """The learning rate of the next step from this run's schedule (a resume that changes train.max_steps
    changes it), not the one the saved run computed with its own: a scheduler's load restores its step count and
    last rates, never the optimizer's, and the rate function is never saved."""
    if scheduler is None:
        return
    rates = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, lr in zip(scheduler.optimizer.param_groups, rates):
        group["lr"] = lr
    scheduler._last_lr = rates  # (what get_last_lr() answers; torch keeps it in this field)


def _ensure_state(partitions: PartitionMap, inner: torch.optim.Optimizer, saved: sharded.ShardedState, step: int):
    """Every buffer the torch optimizer steps has the state the checkpoint holds for it (the optimizer makes it
    lazily at the first step), with the saved step count where it keeps one. A buffer that is one parameter whole
    (ZeRO-0) gets the kinds the checkpoint holds for that parameter; a flat partition those of its group: an
    optimizer whose groups keep different state (``state_keys(group)``, as muon.MuonWithAdamW's) says which."""
    every = [k for k in saved.kinds if k != sharded.MASTER]
    whole = {f.buffer: f.name for f in partitions.mine() if f.numel == partitions.tensors[f.buffer].numel()}
    state_keys = getattr(inner, "state_keys", lambda group: (*every, "step"))
    for number, (p, group_number) in enumerate(zip(partitions.tensors, partitions.groups)):
        group = inner.param_groups[group_number]
        state, kept = inner.state[p], state_keys(group)
        if number in whole:
            keys = [k for k in saved.kinds_of(whole[number]) if k != sharded.MASTER]
        else:
            keys = [k for k in every if k in kept]
        for key in keys:
            state.setdefault(key, torch.zeros_like(p, memory_format=torch.preserve_format))
        if "step" not in kept:
            continue
        old = state.get("step")
        if isinstance(old, torch.Tensor):
            state["step"] = torch.full_like(old, float(step))
        elif old is not None:
            state["step"] = type(old)(step)
        else:
            on_device = group.get("fused") or group.get("capturable")
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=p.device if on_device else "cpu")
