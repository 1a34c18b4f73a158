"""Trust in a checkpoint read from disk: the COMPLETE manifest (every file's size and sha256), its
verification (on one process, or shared by a job's ranks and agreed among them), and loading ``.pt`` state files
without running code. Why and how: docs/checkpoints.md."""

from __future__ import annotations

import hashlib
import heapq
import json
import pickle
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from megatransformer.checkpoint.directory import (
    COMPLETE,
    LATEST,
    atomic_write,
    complete_checkpoints,
    latest_pointer,
    step_of,
    warn,
)
from megatransformer.config import ConfigError

MANIFEST_FORMAT = 1
# The classes DeepSpeed 0.19's state files hold besides tensors and plain containers (found by loading the states
# of ZeRO 0-3, bf16 and CPU-offload checkpoints with weights_only=True; the fp16 loss scaler read from
# DeepSpeed's source). Unpickling them only builds an enum or sets a plain object's fields: no code of the file's
# choosing runs. Named, so that checking a checkpoint needs no DeepSpeed; the training side loads them.
DEEPSPEED_STATE_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class CheckpointDamaged(ConfigError):
    """A file of a checkpoint is missing, cut short, changed since the save, or unreadable."""

    def __init__(self, checkpoint: Path, file: str, reason: str) -> None:
        self.checkpoint, self.file, self.reason = checkpoint, file, reason
        super().__init__(f"checkpoint {checkpoint}: {file}: {reason}")

    def __reduce__(self):  # (sent whole from the rank that found it to the others: its class and fields)
        return _rebuild, (type(self), self.checkpoint, self.file, self.reason)


def _rebuild(cls: type[CheckpointDamaged], checkpoint: Path, file: str, reason: str) -> CheckpointDamaged:
    err = cls.__new__(cls)
    CheckpointDamaged.__init__(err, checkpoint, file, reason)
    return err


class CheckpointUnsafe(CheckpointDamaged):
    """A state file that needs Python objects beyond tensors and plain data to load: refused, never skipped
    (a planted file is not accidental damage to step around)."""

    def __init__(self, file: Path, detail: str) -> None:
        super().__init__(
            file.parent,
            file.name,
            f"holds Python objects beyond tensors and plain data ({detail}); refused, since loading it could run code",
        )


# ------------------------------------------------------------------------------------- manifest


def file_entry(path: Path) -> dict[str, Any]:
    """Size and sha256 of one file, as the manifest lists it (read in 16 MiB pieces)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            digest.update(piece)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def checkpoint_files(path: Path) -> list[str]:
    """Every file of a checkpoint directory but its COMPLETE record, as sorted relative POSIX paths."""
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != COMPLETE)


def write_manifest(path: Path, entries: dict[str, dict[str, Any]] | None = None) -> None:
    """Mark ``path`` complete: write its COMPLETE record (the manifest of its files), atomically and last.
    ``entries`` as :func:`file_entry` gives them; hashed here (on this process) when not given."""
    if entries is None:
        entries = {name: file_entry(path / name) for name in checkpoint_files(path)}
    record = {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": dict(sorted(entries.items()))}
    atomic_write(path / COMPLETE, json.dumps(record, indent=1) + "\n")


def read_manifest(path: Path) -> dict[str, dict[str, Any]] | None:
    """The files the COMPLETE record of ``path`` lists; None for an empty record of a checkpoint written
    before manifests existed. An empty record beside files only this version writes, or a record that is not
    a manifest, is damage."""
    raw = (path / COMPLETE).read_bytes()
    if not raw.strip():
        later = _written_after_manifests(path)
        if later is not None:
            raise CheckpointDamaged(
                path,
                COMPLETE,
                f"empty, but {later}: written by a version that writes a manifest, so its files cannot be verified",
            )
        return None
    try:
        record = json.loads(raw)
        files = record["files"]
        if record.get("format") != MANIFEST_FORMAT or not all(
            isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str) for e in files.values()
        ):
            raise ValueError("unexpected fields")
    except (ValueError, KeyError, TypeError, AttributeError) as err:  # (UnicodeDecodeError is a ValueError)
        raise CheckpointDamaged(path, COMPLETE, f"not a readable manifest ({err.__class__.__name__})") from None
    return files


# What the versions before manifests wrote: trainer.json with exactly these fields beside DeepSpeed's and the
# per-rank .pt states, model.safetensors, config.yaml and tokenizer.json; export and import wrote only the last
# three. Never optimizer.safetensors, index.json or a shard file, nor any field added to trainer.json since
# (sequence_parallel, spikes).
EARLIER_TRAINER_FIELDS = frozenset(
    {"step", "tokens", "bad_steps", "tokenizer_sha256", "world_size", "tensor_parallel", "zero_stage"}
)
EARLIER_WEIGHTS_FILES = frozenset({"model.safetensors", "config.yaml", "tokenizer.json"})


def _written_after_manifests(path: Path) -> str | None:
    """Why a checkpoint with an empty COMPLETE cannot be one of the versions before manifests (None: it can)."""
    for later in ("optimizer.safetensors", "index.json", *sorted(p.name for p in path.glob("shard_*"))):
        if (path / later).exists():
            return f"it holds {later}"
    trainer = path / "trainer.json"
    if not trainer.is_file():
        extra = sorted(set(checkpoint_files(path)) - EARLIER_WEIGHTS_FILES)
        return f"it holds {extra[0]} without a trainer.json" if extra else None
    try:
        fields = json.loads(trainer.read_bytes())
        later = sorted(set(fields) - EARLIER_TRAINER_FIELDS)
        missing = sorted(EARLIER_TRAINER_FIELDS - set(fields))
    except (ValueError, TypeError):
        return "its trainer.json is unreadable"
    if later:
        return f"its trainer.json has fields of later versions ({', '.join(later)})"
    if missing:
        return f"its trainer.json lacks {', '.join(missing)}"
    return None


def is_rank_part(name: str) -> bool:
    """A file of one rank's part of the state (a shard, a rank's loader and RNG state): verified at a resume by
    the ranks that read it (:func:`verify_files`), not by the one that picks the checkpoint."""
    return name.startswith(("shard_", "rank_"))


def verify_checkpoint(path: Path, only: Sequence[str] | None = None, rank_parts: bool = True) -> None:
    """Raise :class:`CheckpointDamaged` naming the first file that is missing, has another size or sha256
    than the manifest lists, or (checking the whole checkpoint) is not listed at all; then
    :class:`CheckpointUnsafe` for a state file whose pickle names a class or function that weights_only
    loading does not allow (beside :data:`DEEPSPEED_STATE_GLOBALS`). ``only``: check just these files, where the
    manifest lists them (init_from, eval, export read no more). ``rank_parts=False``: the files of
    :func:`is_rank_part` are checked for their presence and size only, their contents left to the ranks that
    read them. Local: no collective."""
    files = read_manifest(path)
    if files is None:
        warn(f"checkpoint {path} has no manifest (written by an earlier version): its files are not verified")
        files = {name: {} for name in checkpoint_files(path)}
    else:
        _check_files(path, files, only, hashed=None if rank_parts else lambda name: not is_rank_part(name))
    for name in files:
        if name.endswith(".pt") and (only is None or name in only) and (rank_parts or not is_rank_part(name)):
            _refuse_unsafe_pickle(path / name)


def verify_files(path: Path, names: Collection[str], hashed: bool = True) -> None:
    """:func:`verify_checkpoint` of exactly ``names`` (each must be in the manifest): what a rank checks of the
    files it reads at a resume. ``hashed=False``: their presence and size only. Local: no collective."""
    files = read_manifest(path)
    if files is not None:
        unlisted = sorted(set(names) - set(files))
        if unlisted:
            raise CheckpointDamaged(path, unlisted[0], "missing from the manifest (a file of another save)")
        _check_files(path, files, sorted(names), hashed=None if hashed else lambda name: False)
    for name in sorted(names):
        if hashed and name.endswith(".pt"):
            _refuse_unsafe_pickle(path / name)


def deal_by_size(sizes: Mapping[str, int], world: int) -> list[list[str]]:
    """The names of ``sizes`` dealt to ``world`` ranks, balanced by bytes: the largest first, each to the rank
    with the fewest bytes so far (the lowest of those tied). The same on every rank that computes it."""
    heap = [(0, rank) for rank in range(world)]
    dealt: list[list[str]] = [[] for _ in range(world)]
    for name in sorted(sizes, key=lambda name: (-sizes[name], name)):
        load, rank = heapq.heappop(heap)
        dealt[rank].append(name)
        heapq.heappush(heap, (load + sizes[name], rank))
    return dealt


def hashing_share(path: Path, names: Collection[str]) -> list[str]:
    """The files of ``names`` this rank hashes where the ranks of the process group verify a checkpoint they all
    read together, each file once (:func:`deal_by_size`, the manifest's sizes); all of them without a group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return sorted(names)
    files = read_manifest(path) or {}
    sizes = {name: files.get(name, {}).get("size", 0) for name in names}
    return deal_by_size(sizes, dist.get_world_size())[dist.get_rank()]


def agreed(check: Callable[[], Any]) -> Any:
    """``check()``'s result on every rank, once the ranks agree in one collective that none found the
    checkpoint damaged or unsafe (:class:`CheckpointDamaged`); else every rank raises the first such rank's
    error, naming the file: no rank loads what another refused. Any other error of a rank's check ends every
    rank too (that rank with its own error, the others naming it), never leaving them waiting. Without a
    process group, ``check()``."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return check()
    found: CheckpointDamaged | str | None = None
    result, own = None, None
    try:
        result = check()
    except CheckpointDamaged as err:
        found = err
    except Exception as err:
        own, found = err, f"{err.__class__.__name__}: {str(err).strip()[:200]}"
    everyone: list[CheckpointDamaged | str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, found)
    first = next((err for err in everyone if isinstance(err, CheckpointDamaged)), None)
    if first is not None:
        raise first
    if own is not None:
        raise own
    other = next(((rank, err) for rank, err in enumerate(everyone) if err is not None), None)
    if other is not None:
        raise RuntimeError(f"rank {other[0]} failed checking the checkpoint before loading it: {other[1]}")
    return result


def _check_files(
    path: Path,
    files: dict[str, dict[str, Any]],
    only: Sequence[str] | None,
    hashed: Callable[[str], bool] | None = None,
) -> None:
    """The manifest's part of :func:`verify_checkpoint`; ``hashed``: which of the files to hash (None: all)."""
    names = [n for n in files if only is None or n in only]
    unlisted = sorted(set(checkpoint_files(path)) - set(files)) if only is None else []
    if unlisted:
        raise CheckpointDamaged(path, unlisted[0], "a file the manifest does not list (not from this save)")
    for name in names:  # the cheap checks first: a missing or cut-short file needs no hashing
        file = path / name
        if not file.is_file():
            raise CheckpointDamaged(path, name, "missing")
        size = file.stat().st_size
        if size != files[name]["size"]:
            raise CheckpointDamaged(
                path, name, f"cut short or grown: {size} bytes, the manifest says {files[name]['size']}"
            )
    for name in names:
        if (hashed is None or hashed(name)) and file_entry(path / name)["sha256"] != files[name]["sha256"]:
            raise CheckpointDamaged(path, name, "changed since the save (its sha256 differs from the manifest's)")


def resume_candidates(root: Path) -> list[Path]:
    """What ``resume=auto`` tries, in order: the checkpoint `latest` names, then the complete ones older than
    it, newest first. (Newer complete ones than `latest` belong to a trajectory this run left by resuming
    from an older checkpoint, and are never resumed by accident.)"""
    named, why = latest_pointer(root)
    if why is not None:
        warn(f"{root / LATEST} {why}: ignored; taking the newest complete checkpoint in {root}")
    complete = complete_checkpoints(root)
    if named is None:
        return complete
    return [named, *(p for p in complete if step_of(p) < step_of(named))]


def newest_intact(root: Path, found: Sequence[CheckpointDamaged] = (), rank_parts: bool = True) -> Path | None:
    """The first of :func:`resume_candidates` that verifies (``rank_parts``: as :func:`verify_checkpoint`) and
    is not one ``found`` damaged already (by the ranks that read its shards); one warning for each damaged one
    skipped. None when there is no complete checkpoint; an error when there are some but all are damaged."""
    known = {err.checkpoint.resolve(): err for err in found}
    damaged: list[CheckpointDamaged] = []
    for path in resume_candidates(root):
        try:
            if path.resolve() in known:
                raise known[path.resolve()]
            verify_checkpoint(path, rank_parts=rank_parts)
        except CheckpointUnsafe:
            raise
        except CheckpointDamaged as err:
            damaged.append(err)
            continue
        for err in damaged:
            warn(f"{err}: skipped, resuming from {path.name}")
        return path
    if damaged:
        raise ConfigError(
            f"resume=auto: every complete checkpoint in {root} is damaged (the newest: "
            f"{damaged[0]}); restore one, or start a new run_dir"
        )
    return None


# ------------------------------------------------------------------------------- safe loading


def _refuse_unsafe_pickle(file: Path) -> None:
    """:class:`CheckpointUnsafe` when the pickle of ``file`` names a global weights_only loading refuses.
    torch reads just the pickle, statically (milliseconds, no tensor data). A file it cannot scan is left to
    :func:`safe_load`, which refuses the same and more (objects made while unpickling)."""
    try:
        unsafe = set(torch.serialization.get_unsafe_globals_in_checkpoint(file)) - set(DEEPSPEED_STATE_GLOBALS)
    except Exception:  # (not a zip-format file, or unreadable: the load names it)
        return
    if unsafe:
        raise CheckpointUnsafe(file, ", ".join(sorted(unsafe)[:3]))


def safe_load(path: Path, map_location: Any = None, allowed: Sequence[type] = ()) -> Any:
    """``torch.load(weights_only=True)`` of a checkpoint file, the classes ``allowed`` beside tensors and plain
    data. A file needing any other Python object (a pickle that could run code), or one torch cannot read, is
    a :class:`CheckpointDamaged` naming it."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(list(allowed)):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported (?:global|operand)[^.\n]*", str(err))
        raise CheckpointUnsafe(path, found.group(0) if found else "refused by weights_only") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
        raise CheckpointDamaged(path.parent, path.name, f"unreadable ({reason[:200]})") from None


def load_safetensors(path: Path, name: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor and the metadata of a checkpoint's safetensors file; an unreadable one is damage."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path / name), framework="pt") as f:
            return {key: f.get_tensor(key) for key in f.keys()}, f.metadata() or {}
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointDamaged(path, name, f"unreadable ({str(err)[:200]})") from None
