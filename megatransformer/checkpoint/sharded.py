"""The sharded state of a checkpoint, read and written without DeepSpeed: each rank's shard file (safetensors,
written and hashed in one pass), the index of every piece, and readers that assemble one tensor at a time or
read only the slice a rank needs. Format and reasons: docs/checkpoints.md."""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatransformer.checkpoint.directory import default_file_mode
from megatransformer.checkpoint.integrity import CheckpointDamaged

INDEX = "index.json"
INDEX_FORMAT = 1
MASTER = "fp32"  # the kind of the weights (fp32 masters where the run keeps them apart from its weights)
_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
_ALIGN = 8  # safetensors' header is padded so that the data begins 8-byte aligned


def shard_file(rank: int) -> str:
    return f"shard_{rank:05d}.safetensors"


def piece_key(kind: str, name: str, tp_index: int, start: int) -> str:
    """The name of one piece in a shard file: state ``kind`` of parameter ``name``, flat elements from
    ``start`` of its tensor-parallel slice ``tp_index``."""
    return f"{kind}/{name}/{tp_index}/{start}"


# ------------------------------------------------------------------------------------- writing


class HashingFile:
    """A file written once, front to back, its sha256 computed from the bytes as they go out; fsynced at close."""

    def __init__(self, path: Path) -> None:
        self.path, self.size, self.digest = path, 0, hashlib.sha256()
        self.file = open(path, "wb")  # noqa: SIM115 (closed by close())

    def write(self, data: bytes | memoryview) -> None:
        self.digest.update(data)
        self.file.write(data)
        self.size += len(data) if isinstance(data, bytes) else data.nbytes

    def close(self) -> dict[str, Any]:
        """The manifest entry of the file (its size and sha256)."""
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        os.chmod(self.path, default_file_mode())
        return {"size": self.size, "sha256": self.digest.hexdigest()}

    def abandon(self) -> None:
        self.file.close()
        self.path.unlink(missing_ok=True)


def write_file(path: Path, data: bytes) -> dict[str, Any]:
    """Write ``data`` to ``path``; its manifest entry, hashed as written."""
    out = HashingFile(path)
    try:
        out.write(data)
        return out.close()
    except BaseException:
        out.abandon()
        raise


def write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], metadata: dict[str, str]) -> dict[str, Any]:
    """``tensors`` (contiguous, on the CPU) as a safetensors file, each tensor's bytes written straight from its
    memory and hashed on the way; the file's manifest entry."""
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for key, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": _DTYPES[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-(len(encoded) + 8) % _ALIGN)
    out = HashingFile(path)
    try:
        out.write(struct.pack("<Q", len(encoded)) + encoded)
        for tensor in tensors.values():
            if tensor.numel():
                out.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        return out.close()
    except BaseException:
        out.abandon()
        raise


# ------------------------------------------------------------------------------------- the index


@dataclass(frozen=True)
class Piece:
    """Flat elements [start, stop) of tensor-parallel slice ``tp_index`` of a parameter, in shard ``file``."""

    tp_index: int
    start: int
    stop: int
    file: str


@dataclass(frozen=True)
class ParamLayout:
    """Where a parameter's pieces are: its global shape, the dimension tensor parallelism splits (None: whole
    on every tensor-parallel rank) into ``tp`` slices, and its pieces, which cover every slice once."""

    shape: tuple[int, ...]
    tp_dim: int | None
    tp: int
    pieces: tuple[Piece, ...]

    def slice_shape(self) -> tuple[int, ...]:
        if self.tp_dim is None:
            return self.shape
        return tuple(n // self.tp if d == self.tp_dim else n for d, n in enumerate(self.shape))


def index_record(
    params: Mapping[str, ParamLayout],
    kinds: list[str],
    aliases: Mapping[str, str],
    save: str,
    step: int,
    param_kinds: Mapping[str, list[str]] | None = None,
) -> dict[str, Any]:
    """index.json: every parameter's layout, the kinds of state its pieces hold (``param_kinds``, where a
    parameter has fewer than ``kinds``: an optimizer that keeps other state for some parameters, as Muon's momentum
    beside AdamW's moments), tied names, and the save it belongs to."""
    param_kinds = param_kinds or {}
    return {
        "format": INDEX_FORMAT,
        "save": save,
        "step": step,
        "kinds": kinds,
        "aliases": dict(aliases),
        "params": {
            name: {
                "shape": list(p.shape),
                "tp_dim": p.tp_dim,
                "tp": p.tp,
                "pieces": [[q.tp_index, q.start, q.stop, q.file] for q in p.pieces],
                "kinds": list(param_kinds.get(name, kinds)),
            }
            for name, p in params.items()
        },
    }


def check_layout(name: str, layout: ParamLayout) -> None:
    """:func:`check_cover` of a layout read from disk, after the checks that make its arithmetic valid: a shape
    of non-negative sizes, a split dimension of the shape that divides among the slices, pieces of those slices."""
    if not all(isinstance(n, int) and n >= 0 for n in layout.shape) or layout.tp < 1:
        raise ValueError(f"{name}: shape {list(layout.shape)} split {layout.tp} ways")
    if layout.tp_dim is not None:
        if not (isinstance(layout.tp_dim, int) and 0 <= layout.tp_dim < len(layout.shape)):
            raise ValueError(f"{name}: split along dimension {layout.tp_dim} of shape {list(layout.shape)}")
        if layout.shape[layout.tp_dim] % layout.tp:
            raise ValueError(f"{name}: dimension {layout.tp_dim} of shape {list(layout.shape)} split {layout.tp} ways")
    elif layout.tp != 1:
        raise ValueError(f"{name}: split {layout.tp} ways along no dimension")
    for piece in layout.pieces:
        if not (isinstance(piece.tp_index, int) and 0 <= piece.tp_index < layout.tp):
            raise ValueError(f"{name}: a piece of slice {piece.tp_index} of {layout.tp}")
        if not (isinstance(piece.start, int) and isinstance(piece.stop, int) and 0 <= piece.start < piece.stop):
            raise ValueError(f"{name}: a piece of elements [{piece.start}, {piece.stop})")
    check_cover(name, layout)


def check_cover(name: str, layout: ParamLayout) -> None:
    """Every element of every tensor-parallel slice in exactly one piece (else the save is wrong, not the disk)."""
    numel = math.prod(layout.slice_shape())
    for tp_index in range(layout.tp):
        spans = sorted((q.start, q.stop) for q in layout.pieces if q.tp_index == tp_index)
        at = 0
        for start, stop in spans:
            if start != at:
                raise ValueError(f"{name}: slice {tp_index} has a gap or an overlap at element {at}")
            at = stop
        if at != numel:
            raise ValueError(
                f"{name}: the pieces of slice {tp_index} cover {at} elements, its shape {list(layout.slice_shape())} "
                f"{numel}"
            )


# ------------------------------------------------------------------------------------- reading


def _runs(
    shape: tuple[int, ...], dim: int, saved: int, wanted: int, tp_index: int, start: int, stop: int
) -> Iterator[tuple[int, int, int, int]]:
    """Flat elements [start, stop) of slice ``tp_index`` of a ``wanted``-way split along ``dim`` as runs of the
    slices of a ``saved``-way split: (saved slice, lo, hi, at): its flat elements [lo, hi) are the request's
    [at, at + hi - lo). A row (one index of the dimensions before ``dim``) holds each slice's part contiguously."""
    width = math.prod(shape[dim:])
    new, old = width // wanted, width // saved
    at = 0
    while at < stop - start:
        row, col = divmod(start + at, new)
        n = min(stop - start - at, new - col)
        column = tp_index * new + col  # (in the row, of the whole parameter)
        while n:
            t, c = divmod(column, old)
            m = min(n, old - c)
            yield t, row * old + c, row * old + c + m, at
            column, at, n = column + m, at + m, n - m


class ShardReader:
    """One shard file, read by element ranges straight into the caller's tensors (no copy in between): its
    safetensors header parsed once."""

    def __init__(self, checkpoint: Path, file: str) -> None:
        self.checkpoint, self.file = checkpoint, file
        try:
            self.handle = open(checkpoint / file, "rb", buffering=0)  # noqa: SIM115 (kept open while reading)
            size = self.handle.seek(0, os.SEEK_END)
            self.handle.seek(0)
            (length,) = struct.unpack("<Q", self.handle.read(8))
            if not 0 < length <= size - 8:
                raise ValueError(f"a header of {length} bytes in a file of {size}")
            header = json.loads(self.handle.read(length))
            self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
            self.entries: dict[str, dict[str, Any]] = header
            self.base, self.size = 8 + length, size
        except FileNotFoundError:
            raise CheckpointDamaged(checkpoint, file, "missing") from None
        except (OSError, ValueError, struct.error, AttributeError) as err:
            raise CheckpointDamaged(checkpoint, file, f"unreadable ({str(err)[:200]})") from None

    def read_into(self, key: str, first: int, out: torch.Tensor) -> None:
        """Elements [first, first + out.numel()) of fp32 tensor ``key`` into ``out`` (contiguous, on the CPU)."""
        entry = self.entries.get(key)
        if entry is None or entry.get("dtype") != "F32":
            raise CheckpointDamaged(self.checkpoint, self.file, f"unreadable (no fp32 tensor {key})")
        begin, end = entry["data_offsets"]
        offset, nbytes = self.base + begin + 4 * first, 4 * out.numel()
        if offset + nbytes > min(self.base + end, self.size):
            raise CheckpointDamaged(self.checkpoint, self.file, f"unreadable ({key} is cut short)")
        view = memoryview(out.numpy()).cast("B")
        done = 0
        while done < nbytes:
            self.handle.seek(offset + done)
            got = self.handle.readinto(view[done:])
            if not got:
                raise CheckpointDamaged(self.checkpoint, self.file, f"unreadable ({key} is cut short)")
            done += got


class ShardedState:
    """The sharded state of a checkpoint directory, read one parameter (or one slice of one) at a time. Each
    shard is opened once, lazily, and checked to belong to this save (the index's save id and step)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            record = json.loads((path / INDEX).read_bytes())
            if record.get("format") != INDEX_FORMAT:
                raise ValueError("format")
            self.save, self.step = str(record["save"]), int(record["step"])
            self.kinds: list[str] = list(record["kinds"])
            self.aliases: dict[str, str] = dict(record["aliases"])
            self.params = {
                name: ParamLayout(tuple(p["shape"]), p["tp_dim"], int(p["tp"]), tuple(Piece(*q) for q in p["pieces"]))
                for name, p in record["params"].items()
            }
            self._kinds = {name: list(p.get("kinds", self.kinds)) for name, p in record["params"].items()}
        except FileNotFoundError:
            raise CheckpointDamaged(path, INDEX, "missing") from None
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointDamaged(path, INDEX, f"unreadable ({err.__class__.__name__})") from None
        for name, layout in self.params.items():  # (a reader never returns an element no piece holds)
            try:
                check_layout(name, layout)
            except ValueError as err:
                raise CheckpointDamaged(path, INDEX, f"{err} (the index does not describe its pieces)") from None
        self._open: dict[str, ShardReader] = {}
        self._sorted: dict[str, dict[int, tuple[list[int], list[Piece]]]] = {}

    def kinds_of(self, name: str) -> list[str]:
        """The kinds of state saved for parameter ``name`` (its weights, and the optimizer state it had)."""
        return self._kinds[self.aliases.get(name, name)]

    def names(self) -> list[str]:
        """Every name of the model's state: each parameter, then the other names of tied ones."""
        return [*self.params, *self.aliases]

    def _shard(self, file: str) -> ShardReader:
        if file not in self._open:
            reader = ShardReader(self.path, file)
            meta = reader.metadata
            if meta.get("save") != self.save or meta.get("step") != str(self.step):
                raise CheckpointDamaged(
                    self.path,
                    file,
                    f"a shard of another save (step {meta.get('step')}, save {meta.get('save', '?')[:8]}; this "
                    f"checkpoint is step {self.step}, save {self.save[:8]})",
                )
            self._open[file] = reader
        return self._open[file]

    def _spans(
        self, name: str, tp_index: int, tp: int, tp_dim: int | None, start: int, stop: int
    ) -> Iterator[tuple[Piece, int, int, int]]:
        """(piece, lo, hi, at): the saved elements that make flat elements [start, stop) of tensor-parallel slice
        ``tp_index`` of ``tp`` (split along ``tp_dim``) of ``name``: elements [lo, hi) of ``piece``'s slice (its
        flat positions) are the request's [at, at + hi - lo)."""
        layout = self.params[name]
        saved = layout.tp if layout.tp_dim is not None else 1
        wanted = tp if tp_dim is not None else 1
        if saved == wanted:
            runs: Iterator[tuple[int, int, int, int]] = iter([(tp_index if wanted > 1 else 0, start, stop, 0)])
        else:
            dim = layout.tp_dim if saved > 1 else tp_dim
            runs = _runs(layout.shape, dim, saved, wanted, tp_index, start, stop)
        for t, lo, hi, at in runs:
            starts, pieces = self._slice_pieces(name, t)
            for piece in pieces[max(bisect.bisect_right(starts, lo) - 1, 0) :]:
                if piece.start >= hi:
                    break
                a, b = max(lo, piece.start), min(hi, piece.stop)
                if a < b:
                    yield piece, a, b, at + a - lo

    def _slice_pieces(self, name: str, tp_index: int) -> tuple[list[int], list[Piece]]:
        """The pieces of ``name``'s saved slice ``tp_index`` in order, and their starts (to bisect)."""
        if name not in self._sorted:
            by_slice: dict[int, tuple[list[int], list[Piece]]] = {}
            for piece in sorted(self.params[name].pieces, key=lambda q: (q.tp_index, q.start)):
                starts, pieces = by_slice.setdefault(piece.tp_index, ([], []))
                starts.append(piece.start)
                pieces.append(piece)
            self._sorted[name] = by_slice
        return self._sorted[name].get(tp_index, ([], []))

    def files_of(self, name: str, tp_index: int, tp: int, tp_dim: int | None, start: int, stop: int) -> set[str]:
        """The shard files :meth:`slice_of` reads for these arguments (the files of every kind of state)."""
        return {piece.file for piece, *_ in self._spans(name, tp_index, tp, tp_dim, start, stop)}

    def slice_of(
        self, name: str, kind: str, tp_index: int, tp: int, tp_dim: int | None, start: int, stop: int
    ) -> torch.Tensor:
        """Flat elements [start, stop) of tensor-parallel slice ``tp_index`` of ``tp`` (split along ``tp_dim``) of
        state ``kind`` of ``name``, on any layout: only the saved elements it holds are read, each straight into
        the tensor returned (the only memory this takes)."""
        out = torch.empty(stop - start, dtype=torch.float32)
        filled = 0
        for piece, lo, hi, at in self._spans(name, tp_index, tp, tp_dim, start, stop):
            key = piece_key(kind, name, piece.tp_index, piece.start)
            self._shard(piece.file).read_into(key, lo - piece.start, out[at : at + hi - lo])
            filled += hi - lo
        if filled != stop - start:  # (never memory that was not read: the index covers the shape, see check_layout)
            raise CheckpointDamaged(
                self.path, INDEX, f"{name}: its pieces hold {filled} of the {stop - start} elements asked for"
            )
        return out

    def check_shards(self, files: Iterator[str] | set[str]) -> None:
        """Open each of ``files`` (shard files) as :meth:`slice_of` would: a shard of another save is an error
        now, before any of it is read."""
        for file in sorted(files):
            if file.startswith("shard_"):
                self._shard(file)

    def tensor(self, name: str, kind: str = MASTER) -> torch.Tensor:
        """State ``kind`` of parameter ``name`` whole, in fp32, assembled from its pieces."""
        name = self.aliases.get(name, name)
        shape = self.params[name].shape
        return self.slice_of(name, kind, 0, 1, None, 0, math.prod(shape)).view(shape)

    def weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, fp32 tensor) of the whole model, one tensor at a time; a tied tensor under each of its names."""
        for name in self.names():
            yield name, self.tensor(name)


# ------------------------------------------------------------------------------------- conversion


def convert_consolidated(path: Path) -> Path:
    """Rewrite a checkpoint of the format before shards (DeepSpeed's states beside model.safetensors and
    optimizer.safetensors, which hold the whole weights and optimizer state) as a sharded one of one piece per
    parameter, in place: the new directory is written beside it and swapped in when complete (a conversion cut
    short is finished by :func:`finish_conversions`). The loader and RNG states, trainer state, config and
    tokenizer are kept; DeepSpeed's files are dropped. Each parameter keeps the kinds of state it had (Muon's
    matrices a momentum, the others Adam's moments). A file that does not hold what that format wrote is an
    error naming it."""
    import secrets
    import shutil

    from megatransformer.checkpoint.directory import CONFIG, OPTIMIZER, TOKENIZER, TRAINER_STATE, WEIGHTS, fsync_dir
    from megatransformer.checkpoint.integrity import load_safetensors, read_manifest, verify_checkpoint, write_manifest

    verify_checkpoint(path)
    if read_manifest(path) is None or not (path / OPTIMIZER).is_file():
        raise CheckpointDamaged(path, OPTIMIZER, "missing: only checkpoints with the whole optimizer state convert")
    try:
        step = json.loads((path / TRAINER_STATE).read_bytes())["step"]
        if not isinstance(step, int) or step < 0:
            raise ValueError("step")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise CheckpointDamaged(path, TRAINER_STATE, f"no step count in it ({err.__class__.__name__})") from None
    moments, meta = load_safetensors(path, OPTIMIZER)
    weights, _ = load_safetensors(path, WEIGHTS)
    try:
        adam_step = int(meta.get("adam_step", "0"))
        scheduler = json.loads(meta["lr_scheduler"]) if meta.get("lr_scheduler") else None
    except ValueError as err:
        raise CheckpointDamaged(path, OPTIMIZER, f"its metadata is unreadable ({err.__class__.__name__})") from None
    param_kinds: dict[str, list[str]] = {}
    if adam_step:
        for key in moments:
            kind, _, name = key.partition("/")
            if name not in weights or moments[key].numel() != weights[name].numel():
                raise CheckpointDamaged(path, OPTIMIZER, f"{key}: no weight of its size in {WEIGHTS}")
            param_kinds.setdefault(name, []).append(kind)
    # (the state is per parameter, a tied one once; without it every name is kept as a parameter)
    params = [name for name in weights if name in param_kinds] or list(weights)
    kinds = [MASTER, *sorted({kind for have in param_kinds.values() for kind in have})]
    aliases = {}
    for name, tensor in weights.items():
        if name not in params:
            same = next((p for p in params if p != name and torch.equal(weights[p], tensor)), None)
            if same is None:
                raise CheckpointDamaged(
                    path, OPTIMIZER, f"no state for {name}, which is no other name of a parameter in {WEIGHTS}"
                )
            aliases[name] = same
    file, save = shard_file(0), secrets.token_hex(16)
    tensors: dict[str, torch.Tensor] = {}
    layouts = {}
    for name in params:
        for kind in (MASTER, *sorted(param_kinds.get(name, []))):
            tensors[piece_key(kind, name, 0, 0)] = (
                (weights[name] if kind == MASTER else moments[f"{kind}/{name}"]).reshape(-1).float().contiguous()
            )
        layouts[name] = ParamLayout(tuple(weights[name].shape), None, 1, (Piece(0, 0, weights[name].numel(), file),))
    partial = {name: [MASTER, *sorted(have)] for name, have in param_kinds.items() if len(have) < len(kinds) - 1}
    record = index_record(layouts, kinds, aliases, save, step, partial)
    record["optimizer"] = {"step": adam_step, "lr_scheduler": scheduler, "loss_scaler": None}
    new, old = _conversion_dirs(path)
    shutil.rmtree(new, ignore_errors=True)
    new.mkdir()
    entries = {file: write_safetensors(new / file, tensors, {"save": save, "step": str(step)})}
    entries[INDEX] = write_file(new / INDEX, json.dumps(record).encode())
    kept = [
        p.name for p in path.iterdir() if p.name.startswith("rank_") or p.name in (TRAINER_STATE, CONFIG, TOKENIZER)
    ]
    for name in kept:
        entries[name] = write_file(new / name, (path / name).read_bytes())
    write_manifest(new, entries)  # (the new directory complete: from here on the conversion is finished, not undone)
    path.rename(old)
    new.rename(path)
    fsync_dir(path.parent)
    shutil.rmtree(old)
    return path


def _conversion_dirs(path: Path) -> tuple[Path, Path]:
    """Where :func:`convert_consolidated` writes the new directory, and where it moves the old one aside."""
    return path.with_name(f".{path.name}.converting"), path.with_name(f".{path.name}.consolidated")


def finish_conversions(root: Path) -> list[str]:
    """Finish or undo the conversions in checkpoints directory ``root`` that a kill cut short between their
    renames (the checkpoint hidden under both of its temporary names): a complete new directory is moved into
    place, else the old one back. Returns a line for each one done."""
    import shutil

    from megatransformer.checkpoint.directory import COMPLETE, fsync_dir

    done = []
    for new in sorted(root.glob(".step_*.converting")):
        path = root / new.name[1 : -len(".converting")]
        _, old = _conversion_dirs(path)
        if path.exists():  # (a conversion cut short before its renames: the checkpoint is where it was)
            shutil.rmtree(new, ignore_errors=True)
            continue
        if (new / COMPLETE).is_file():
            new.rename(path)
            done.append(f"{path.name}: finished its conversion to the sharded format, cut short by a kill")
        elif old.is_dir():
            old.rename(path)
            done.append(f"{path.name}: undid its conversion to the sharded format, cut short by a kill")
            shutil.rmtree(new, ignore_errors=True)
        fsync_dir(root)
    for old in sorted(root.glob(".step_*.consolidated")):
        if (root / old.name[1 : -len(".consolidated")]).exists():
            shutil.rmtree(old, ignore_errors=True)
    return done
