"""Checkpoints: exact resume through DeepSpeed, plus consolidated weights for fine-tuning and export.

Layout::

    RUN_DIR/checkpoints/
      latest                 name of the newest complete checkpoint (replaced atomically, written last)
      step_000100/
        mp_rank_*_model_states.pt, *optim_states.pt   DeepSpeed: model, optimizer, LR scheduler per rank/shard
        rank_00000.pt ...    per rank: data-loader state and RNG states (python, numpy, torch)
        trainer.json         step, tokens seen, bad-step counter, tokenizer hash, layout (world, tp, zero)
        model.safetensors    the whole model's fp32 (master) weights, ZeRO and TP shards merged
                             (no DeepSpeed needed to read them; init_from and export use only this)
        optimizer.safetensors  the whole Adam state the same way (exp_avg, exp_avg_sq; step count and LR
                             schedule in its metadata): what an elastic resume on another layout loads
                             (training/elastic.py)
        config.yaml          the resolved run config
        tokenizer.json       the tokenizer the data was made with
        COMPLETE             the manifest: every other file's size and sha256; written last (atomically),
                             after every rank finished: only then does `latest` point here

A run killed during a save leaves a directory without COMPLETE, and `latest` still names the previous one.

Trust (what a checkpoint read from disk can and cannot do):
- Integrity: loading checks every file against the manifest first (missing, another size, another sha256,
  a file the manifest does not list): ``resume=auto`` skips a damaged checkpoint with one warning naming the
  file and falls back to the newest intact older one; an explicit path (``resume=``, ``init_from=``,
  ``--checkpoint``) is an error naming the file (exit 2). init_from, eval, generate and export check only the
  files they read (model.safetensors, config.yaml, tokenizer.json). sha256 because it is the standard one
  (``sha256sum`` checks a file by hand) and, with the SHA extensions of current x86 CPUs, hashes at ~1.7 GB/s
  on one core, faster than most disks deliver a checkpoint: a faster non-cryptographic hash would not make
  a save or a resume noticeably shorter. The hashing of a save is shared among the ranks.
  A COMPLETE without a manifest (checkpoints of earlier versions) is accepted with a warning that its
  files are not verified.
- No code: every ``.pt`` file (DeepSpeed's model and optimizer states and our per-rank states) is read with
  ``torch.load(weights_only=True)`` (:func:`safe_load`), DeepSpeed's own loads too: the engine's pluggable
  ``checkpoint_engine`` is replaced, before a resume, by a subclass of its torch engine that loads this way.
  Only the few DeepSpeed classes its states hold are allowed (:func:`_deepspeed_safe_globals`). A file that
  needs any other Python object is refused with its name (exit 2), also when the manifest matches it, and
  also under ``resume=auto`` (a planted file is not accidental damage to step around): already by the
  verification, on rank 0 before any engine load (torch's static scan of each pickle), so every rank stops
  with the same message; the weights_only loads stay the guard.
- A `latest` pointer that is unreadable or names no complete checkpoint is ignored (with a warning when
  resuming): the newest complete checkpoint is found by scanning the step directories.
- Files are written with the process umask (0644 by default), so others on a shared file system can read
  them (safetensors writes 0600 on its own; :func:`save_safetensors` corrects that).

What can change between runs:
- resume (exact continuation): the same model shape (a mismatch is an error listing the fields), the same
  tokenizer (sha256 in trainer.json) and the same global batch (unless resume_elastic=allow_batch_change).
  On the same world size, tensor_parallel and zero_stage DeepSpeed loads its own per-rank states; on another
  one (an elastic resume, training/elastic.py) the engine is built for the new layout and loads
  model.safetensors, optimizer.safetensors and every old rank's loader state.
- init_from (fine-tuning) and ``megatransformer export`` read only model.safetensors, which holds the whole
  model: ZeRO-3 partitions are gathered and tensor-parallel shards concatenated (along TP_PLAN's split
  dimension) when it is written. So any change of data-parallel size and ZeRO stage, and any change of
  tensor-parallel size that divides the heads, kv-heads, d_ff and vocabulary, is supported: the new run's
  AutoTP splits the full weights again, and they carry no trace of the source's TP size (tests: TP 2 -> 1
  and 2 -> 2 across ZeRO stages, and the TP=2 file equal to the TP=1 run's, in tests/test_train_weights.py).
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import os
import pickle
import random
import shutil
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from megatransformer.config import ConfigError, ModelConfig, RunConfig, dump_config, validate
from megatransformer.model.tp_plan import partition_dim

COMPLETE = "COMPLETE"
WEIGHTS = "model.safetensors"
MANIFEST_FORMAT = 1
# The files init_from, eval, generate and export read (the ones present are verified before use).
WEIGHTS_FILES = (WEIGHTS, "config.yaml", "tokenizer.json")
_STEP_DIR = re.compile(r"step_(\d+)")
# Fields that change parameter shapes or names: they must match to load weights.
SHAPE_FIELDS = ("arch", "d_model", "n_layers", "n_decoder_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                "norm", "norm_position", "position", "ffn", "bias", "tie_embeddings", "share_embeddings",
                "final_norm")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_root(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) / "checkpoints"


class CheckpointDamaged(ConfigError):
    """A file of a checkpoint is missing, cut short, changed since the save, or unreadable."""

    def __init__(self, checkpoint: Path, file: str, reason: str) -> None:
        self.checkpoint, self.file, self.reason = checkpoint, file, reason
        super().__init__(f"checkpoint {checkpoint}: {file}: {reason}")


class CheckpointUnsafe(CheckpointDamaged):
    """A state file that needs Python objects beyond tensors and plain data to load: refused, never skipped
    (a planted file is not accidental damage to step around)."""

    def __init__(self, file: Path, detail: str) -> None:
        super().__init__(file.parent, file.name, f"holds Python objects beyond tensors and plain data ({detail}); "
                                                 "refused, since loading it could run code")


def warn(message: str) -> None:
    """A warning on stderr, from the first rank only (every rank may take the same decision)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _step_of(path: Path) -> int:
    return int(_STEP_DIR.fullmatch(path.name).group(1))


def complete_checkpoints(root: Path) -> list[Path]:
    """Step directories with a COMPLETE marker, newest (highest step) first; nothing else is read."""
    found = [p for p in root.glob("step_*") if _STEP_DIR.fullmatch(p.name) and (p / COMPLETE).is_file()]
    return sorted(found, key=_step_of, reverse=True)


def _latest_pointer(root: Path) -> tuple[Path | None, str | None]:
    """The complete checkpoint `latest` names, or (None, why it is ignored); (None, None) when there is none."""
    pointer = root / "latest"
    if not pointer.is_file():
        return None, None
    try:
        name = pointer.read_bytes().decode("ascii").strip()
    except (OSError, UnicodeDecodeError) as err:
        return None, f"unreadable ({err.__class__.__name__})"
    if not _STEP_DIR.fullmatch(name):
        return None, f"holds {name[:40]!r}, not a step_NNNNNN name"
    if not (root / name / COMPLETE).is_file():
        return None, f"names {name}, which is not a complete checkpoint"
    return root / name, None


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names; should it be gone or unreadable, the newest complete one. Unverified."""
    named, _ = _latest_pointer(root)
    if named is not None:
        return named
    complete = complete_checkpoints(root)
    return complete[0] if complete else None


def resume_candidates(root: Path) -> list[Path]:
    """What ``resume=auto`` tries, in order: the checkpoint `latest` names, then the complete ones older than
    it, newest first. (Newer complete ones than `latest` belong to a trajectory this run left by resuming
    from an older checkpoint, and are never resumed by accident.)"""
    named, why = _latest_pointer(root)
    if why is not None:
        warn(f"{root / 'latest'} {why}: ignored; taking the newest complete checkpoint in {root}")
    complete = complete_checkpoints(root)
    if named is None:
        return complete
    return [named, *(p for p in complete if _step_of(p) < _step_of(named))]


def newest_intact(root: Path) -> Path | None:
    """The first of :func:`resume_candidates` that verifies; one warning for each damaged one skipped.
    None when there is no complete checkpoint; an error when there are some but all are damaged."""
    candidates = resume_candidates(root)
    damaged: list[CheckpointDamaged] = []
    for path in candidates:
        try:
            verify_checkpoint(path)
        except CheckpointUnsafe:
            raise
        except CheckpointDamaged as err:
            damaged.append(err)
            continue
        for err in damaged:
            warn(f"{err}: skipped, resuming from {path.name}")
        return path
    if damaged:
        raise ConfigError(f"resume=auto: every complete checkpoint in {root} is damaged (the newest: "
                          f"{damaged[0]}); restore one, or start a new run_dir")
    return None


def resolve_resume(cfg: RunConfig) -> Path | None:
    """The checkpoint to resume from, verified: ``auto`` -> the newest intact one or None (fresh start);
    a path (a step directory or a checkpoints directory's `latest`) must exist and be intact.

    With a process group, rank 0 alone reads and verifies and tells the others its answer (or its error),
    so every rank takes the same checkpoint, or fails with the same message, before any engine load."""
    return _on_first_rank(lambda: _resolve_resume(cfg))


def _resolve_resume(cfg: RunConfig) -> Path | None:
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        return newest_intact(checkpoint_root(cfg))
    path = locate_resume(cfg)
    try:
        verify_checkpoint(path)
    except CheckpointDamaged as err:
        hint = "" if isinstance(err, CheckpointUnsafe) else ("; resume from another checkpoint (resume=auto "
                                                             "skips damaged ones)")
        raise ConfigError(f"resume={cfg.resume}: {err}{hint}") from None
    return path


def locate_resume(cfg: RunConfig) -> Path:
    """The checkpoint an explicit ``resume=PATH`` names (a step directory, or a checkpoints directory's
    `latest`), marked complete; not yet verified. Cheap: every rank can ask before engines start."""
    path = Path(cfg.resume)
    if (path / "latest").is_file() and not (path / COMPLETE).is_file():  # a checkpoints directory
        found = latest_checkpoint(path)
        if found is None:
            raise ConfigError(f"resume={cfg.resume}: its `latest` checkpoint is incomplete or missing")
        path = found
    elif not (path / COMPLETE).is_file():
        raise ConfigError(f"resume={cfg.resume} is not a complete checkpoint directory (no {COMPLETE} marker); "
                          "use resume=auto to take the latest complete one")
    return path


def _on_first_rank(compute: Callable[[], Any]) -> Any:
    """``compute()`` on rank 0, its result on every rank; should it fail, rank 0 raises its error and the
    others a ConfigError with the same message (none is left waiting)."""
    if not (dist.is_available() and dist.is_initialized()):
        return compute()
    box: list[Any] = [(None, None)]
    failure: Exception | None = None
    if dist.get_rank() == 0:
        try:
            box[0] = (compute(), None)
        except Exception as err:
            failure, box[0] = err, (None, str(err))
    dist.broadcast_object_list(box, src=0)
    if failure is not None:
        raise failure
    value, error = box[0]
    if error is not None:
        raise ConfigError(error)
    return value


# --------------------------------------------------------------------------------- integrity


def file_entry(path: Path) -> dict[str, Any]:
    """Size and sha256 of one file, as the manifest lists it (read in 16 MiB pieces)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while piece := f.read(1 << 24):
            digest.update(piece)
    return {"size": path.stat().st_size, "sha256": digest.hexdigest()}


def _checkpoint_files(path: Path) -> list[str]:
    """Every file of a checkpoint directory but its COMPLETE record, as sorted relative POSIX paths."""
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file() and p.name != COMPLETE)


def _shared(names: Sequence[str], work: Callable[[str], Any]) -> dict[str, Any]:
    """``work`` on every name, the names dealt round-robin to the ranks of the process group (all of them
    here without one); every rank gets the whole result. A collective when there is a process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return {name: work(name) for name in names}
    rank, world = dist.get_rank(), dist.get_world_size()
    parts: list[dict[str, Any] | None] = [None] * world
    dist.all_gather_object(parts, {name: work(name) for name in names[rank::world]})
    return {name: value for part in parts for name, value in part.items()}


def write_manifest(path: Path, entries: dict[str, dict[str, Any]] | None = None) -> None:
    """Mark ``path`` complete: write its COMPLETE record (the manifest of its files), atomically and last.
    ``entries`` as :func:`file_entry` gives them; hashed here (on this process) when not given."""
    if entries is None:
        entries = {name: file_entry(path / name) for name in _checkpoint_files(path)}
    record = {"format": MANIFEST_FORMAT, "algorithm": "sha256", "files": dict(sorted(entries.items()))}
    _atomic_write(path / COMPLETE, json.dumps(record, indent=1) + "\n")


def read_manifest(path: Path) -> dict[str, dict[str, Any]] | None:
    """The files the COMPLETE record of ``path`` lists; None for an empty record (a checkpoint written before
    manifests existed). A record that is not a manifest is damage."""
    raw = (path / COMPLETE).read_bytes()
    if not raw.strip():
        return None
    try:
        record = json.loads(raw)
        files = record["files"]
        if record.get("format") != MANIFEST_FORMAT or not all(
                isinstance(e.get("size"), int) and isinstance(e.get("sha256"), str) for e in files.values()):
            raise ValueError("unexpected fields")
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise CheckpointDamaged(path, COMPLETE, f"not a readable manifest ({err.__class__.__name__})") from None
    return files


def verify_checkpoint(path: Path, only: Sequence[str] | None = None) -> None:
    """Raise :class:`CheckpointDamaged` naming the first file that is missing, has another size or sha256
    than the manifest lists, or (checking the whole checkpoint) is not listed at all; then
    :class:`CheckpointUnsafe` for a state file whose pickle names a class or function that
    weights_only loading does not allow (every rank learns it here, before any of them loads a file).
    ``only``: check just these files, where the manifest lists them (init_from, eval, export read no more).
    Local: no collective."""
    files = read_manifest(path)
    if files is None:
        warn(f"checkpoint {path} has no manifest (written by an earlier version): its files are not verified")
        files = {name: {} for name in _checkpoint_files(path)}
    else:
        _check_files(path, files, only)
    for name in files:
        if name.endswith(".pt") and (only is None or name in only):
            _refuse_unsafe_pickle(path / name)


def _check_files(path: Path, files: dict[str, dict[str, Any]], only: Sequence[str] | None) -> None:
    """The manifest's part of :func:`verify_checkpoint`."""
    names = [n for n in files if only is None or n in only]
    unlisted = sorted(set(_checkpoint_files(path)) - set(files)) if only is None else []
    if unlisted:
        raise CheckpointDamaged(path, unlisted[0], "a file the manifest does not list (not from this save)")
    for name in names:  # the cheap checks first: a missing or cut-short file needs no hashing
        file = path / name
        if not file.is_file():
            raise CheckpointDamaged(path, name, "missing")
        size = file.stat().st_size
        if size != files[name]["size"]:
            raise CheckpointDamaged(path, name, f"cut short or grown: {size} bytes, the manifest says "
                                                f"{files[name]['size']}")
    for name in names:
        if file_entry(path / name)["sha256"] != files[name]["sha256"]:
            raise CheckpointDamaged(path, name, "changed since the save (its sha256 differs from the manifest's)")


def saved_config(path: Path) -> RunConfig:
    return _read_file(path, "config.yaml", lambda text: validate(yaml.safe_load(text)))


def check_same_shapes(saved: ModelConfig, current: ModelConfig, what: str) -> None:
    diffs = [f"model.{f}: {getattr(saved, f)} in the checkpoint, {getattr(current, f)} now"
             for f in SHAPE_FIELDS if getattr(saved, f) != getattr(current, f)]
    if diffs:
        raise ConfigError(f"{what} has another model shape: " + "; ".join(diffs))


# ------------------------------------------------------------------------------------ saving


@dataclass
class TrainerState:
    step: int
    tokens: int
    bad_steps: int
    tokenizer_sha256: str | None
    world_size: int
    tensor_parallel: int
    zero_stage: int
    spikes: dict[str, Any] = field(default_factory=dict)  # the loss-spike ladder's state (training/spikes.py)


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": repr(random.getstate()),
        "numpy": [np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import ast

    random.setstate(_tupleize(ast.literal_eval(state["python"])))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


def _tupleize(value):
    return tuple(_tupleize(v) for v in value) if isinstance(value, (list, tuple)) else value


def full_state_dict(engine, cfg: RunConfig) -> dict[str, torch.Tensor] | None:
    """fp32 weights of the whole model on rank 0, one tensor at a time (a model larger than a device's memory
    is never whole on a device): the optimizer's fp32 master copy where there is one (bf16/fp16 training,
    ZeRO partitions gathered), tensor-parallel shards concatenated. A collective: every rank calls it."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters = functools.cache(lambda: fp16_optimizer_masters(engine.optimizer))

    def fp32(tensor: torch.Tensor) -> torch.Tensor:
        full = safe_get_full_fp32_param(tensor) if isinstance(tensor, torch.nn.Parameter) else None
        return masters().get(id(tensor), tensor) if full is None else full

    return consolidate(engine, cfg, fp32, engine.module.state_dict(keep_vars=True).items())


def consolidate(engine, cfg: RunConfig, value: Callable[[torch.Tensor], torch.Tensor],
                named: Any) -> dict[str, torch.Tensor] | None:
    """``value`` of every (name, tensor) of ``named`` as one whole fp32 tensor on rank 0 (None elsewhere), one
    at a time: ``value`` gives this rank's tensor-parallel shard (gathering ZeRO partitions itself), the shards
    are concatenated along TP_PLAN's dimension here. A tensor under two names (tied weights) is gathered once
    and stored under both (safetensors stores no two names for one storage). A collective."""
    is_main, tp = dist.get_rank() == 0, cfg.parallel.tensor_parallel
    state: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor | None] = {}
    for name, tensor in named:
        tied = id(tensor) in done
        if not tied:
            full = value(tensor).detach().float()
            dim = partition_dim(name) if tp > 1 else None
            if dim is not None:
                full = _gather_shards(full, dim, tp)
            done[id(tensor)] = full.cpu().clone() if is_main else None
        if is_main:
            state[name] = done[id(tensor)].clone() if tied else done[id(tensor)]
    return state if is_main else None


def fp16_optimizer_masters(optimizer, key: str | None = None) -> dict[int, torch.Tensor]:
    """bf16/fp16 without ZeRO: DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer keep fp32 masters (one
    flat tensor, or one tensor per parameter, per group) that ``safe_get_full_fp32_param`` does not know
    about; map each low-precision parameter to its master, or with ``key`` to the master's optimizer state
    ``key`` (views: writing them writes the state; masters without that state yet are left out)."""
    from torch._utils import _unflatten_dense_tensors

    low = getattr(optimizer, "fp16_groups", None)
    if low is None:
        return {}

    def state_of(master: torch.Tensor) -> torch.Tensor | None:
        return master if key is None else optimizer.optimizer.state.get(master, {}).get(key)

    if hasattr(optimizer, "fp32_groups_flat"):
        flats = [state_of(f) for f in optimizer.fp32_groups_flat]
        high = [[None] * len(params) if f is None else _unflatten_dense_tensors(f, params)
                for f, params in zip(flats, low)]
    else:
        high = [[state_of(m) for m in masters] for masters in getattr(optimizer, "fp32_groups", [])]
    return {id(p): master for params, masters in zip(low, high) for p, master in zip(params, masters)
            if master is not None}


def _gather_shards(shard: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    from deepspeed.utils import groups

    pieces = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(pieces, shard.contiguous(), group=groups.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=dim)


def save_checkpoint(engine, cfg: RunConfig, state: TrainerState, loader_state: dict,
                    tokenizer_path: str | None, protect_before: int | None = None) -> Path:
    """``protect_before``: the newest checkpoint older than this step outlives ``checkpoint.keep`` (what a
    loss-spike rollback in progress needs)."""
    root = checkpoint_root(cfg)
    tag = step_name(state.step)
    path = root / tag
    rank = dist.get_rank()
    if rank == 0 and path.exists():  # a leftover from a run killed while saving this step
        shutil.rmtree(path)
    dist.barrier()
    engine.save_checkpoint(str(root), tag=tag, save_latest=False)
    torch.save({"loader": loader_state, "rng": rng_state()}, path / f"rank_{rank:05d}.pt")
    weights = full_state_dict(engine, cfg)
    from megatransformer.training.elastic import OPTIMIZER, full_optimizer_state  # (it needs DeepSpeed)

    moments, optimizer_meta = full_optimizer_state(engine, cfg)
    if rank == 0:
        save_safetensors(weights, path / WEIGHTS)
        save_safetensors(moments, path / OPTIMIZER, optimizer_meta)
        (path / "trainer.json").write_text(json.dumps(state.__dict__, indent=2))
        (path / "config.yaml").write_text(dump_config(cfg))
        if tokenizer_path:
            shutil.copyfile(tokenizer_path, path / "tokenizer.json")
    dist.barrier()
    names = [_checkpoint_files(path) if rank == 0 else None]  # one listing, so every rank hashes its share
    dist.broadcast_object_list(names, src=0)
    entries = _shared(names[0], lambda name: file_entry(path / name))
    if rank == 0:
        write_manifest(path, entries)
        _atomic_write(root / "latest", tag)
        _prune(root, cfg.checkpoint.keep, keep=tag, protect_before=protect_before)
    dist.barrier()
    return path


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str] | None = None) -> None:
    """safetensors' ``save_file``, but with the mode any other file gets (0644 under the usual umask):
    safetensors writes a private temporary file (0600) and renames it."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata={"format": "pt", **(metadata or {})})
    os.chmod(path, _default_file_mode())


@functools.cache
def _default_file_mode() -> int:
    """0666 less the process umask. (Python can read the umask only by setting it: set it back at once,
    once per process.)"""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prune(root: Path, keep_last: int, keep: str, protect_before: int | None = None) -> None:
    complete = complete_checkpoints(root)
    protected = next((p.name for p in complete if protect_before is not None and _step_of(p) < protect_before), None)
    for old in complete[keep_last:] if keep_last > 0 else []:
        if old.name not in (keep, protected):
            shutil.rmtree(old, ignore_errors=True)


def rollback_target(cfg: RunConfig, before_step: int) -> Path | None:
    """The newest intact checkpoint of the run older than ``before_step`` (damaged ones skipped with a
    warning), or None; rank 0 verifies, every rank gets its answer."""

    def find() -> Path | None:
        for path in complete_checkpoints(checkpoint_root(cfg)):
            if _step_of(path) >= before_step:
                continue
            try:
                verify_checkpoint(path)
            except CheckpointDamaged as err:
                warn(f"{err}: skipped, looking for an older checkpoint to roll back to")
                continue
            return path
        return None

    return _on_first_rank(find)


def rewind_to(path: Path) -> None:
    """Make ``path`` the newest checkpoint of its run: newer ones (from a trajectory left by a rollback) are
    deleted and `latest` names it. Rank 0 only."""
    root = path.parent
    for newer in complete_checkpoints(root):
        if _step_of(newer) > _step_of(path):
            shutil.rmtree(newer, ignore_errors=True)
    _atomic_write(root / "latest", path.name)


# ----------------------------------------------------------------------------------- loading


def _deepspeed_safe_globals() -> list[type]:
    """The classes DeepSpeed 0.19's states hold besides tensors and plain containers (found by loading the
    states of ZeRO 0-3, bf16 and CPU-offload checkpoints with weights_only=True; the fp16 loss scaler read
    from DeepSpeed's source). Unpickling them only builds an enum or sets a plain object's fields: no code of
    the file's choosing runs. (Allowed for the duration of our loads only, not process-wide.)"""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def _refuse_unsafe_pickle(file: Path) -> None:
    """:class:`CheckpointUnsafe` when the pickle of ``file`` names a global weights_only loading refuses.
    torch reads just the pickle, statically (milliseconds, no tensor data). A file it cannot scan is left to
    :func:`safe_load`, which refuses the same and more (objects made while unpickling)."""
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(file)
    except Exception:  # (not a zip-format file, or unreadable: the load names it)
        return
    if unsafe:
        raise CheckpointUnsafe(file, ", ".join(sorted(unsafe)[:3]))


def safe_load(path: Path, map_location: Any = None) -> Any:
    """``torch.load(weights_only=True)`` of a checkpoint file, DeepSpeed's few state classes allowed.
    A file needing any other Python object (a pickle that could run code), or one torch cannot read, is a
    :class:`CheckpointDamaged` naming it."""
    path = Path(path)
    try:
        with torch.serialization.safe_globals(_deepspeed_safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported (?:global|operand)[^.\n]*", str(err))
        raise CheckpointUnsafe(path, found.group(0) if found else "refused by weights_only") from None
    except (RuntimeError, OSError, EOFError, ValueError) as err:
        reason = str(err).strip().splitlines()[0] if str(err).strip() else err.__class__.__name__
        raise CheckpointDamaged(path.parent, path.name, f"unreadable ({reason[:200]})") from None


def _safe_checkpoint_engine(config: Any):
    """DeepSpeed's torch checkpoint engine (saving unchanged) whose loads are :func:`safe_load`; DeepSpeed
    reads every model and optimizer state file of a resume through ``engine.checkpoint_engine``. (DeepSpeed
    has no configuration key for an engine of one's own; the attribute is where it looks. The class is made
    here so that importing this module does not import DeepSpeed.)"""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    class SafeCheckpointEngine(TorchCheckpointEngine):
        def load(self, path: str, map_location=None):
            return safe_load(Path(path), map_location)

    return SafeCheckpointEngine(config)


def _read_file(path: Path, name: str, parse: Callable[[str], Any]) -> Any:
    """``parse`` of a text file of a checkpoint; an error in it names the file (a checkpoint without a
    manifest is read unverified)."""
    try:
        return parse((path / name).read_text())
    except ConfigError as err:  # (a config.yaml this version does not accept)
        raise CheckpointDamaged(path, name, str(err)) from None
    except (OSError, UnicodeDecodeError, ValueError, TypeError, yaml.YAMLError) as err:
        raise CheckpointDamaged(path, name, f"unreadable ({err.__class__.__name__})") from None


def read_trainer_state(path: Path) -> TrainerState:
    return _read_file(path, "trainer.json", lambda text: TrainerState(**json.loads(text)))


def check_tokenizer(path: Path, state: TrainerState, cfg: RunConfig, tokenizer_sha256: str | None) -> None:
    if tokenizer_sha256 and state.tokenizer_sha256 and tokenizer_sha256 != state.tokenizer_sha256:
        raise ConfigError(f"checkpoint {path} was trained with another tokenizer (sha256 "
                          f"{state.tokenizer_sha256[:12]}, data.tokenizer={cfg.data.tokenizer} has "
                          f"{tokenizer_sha256[:12]}); resume with the same tokenizer, or start a new run "
                          "with init_from=")


def load_checkpoint(engine, cfg: RunConfig, path: Path,
                    tokenizer_sha256: str | None = None) -> tuple[TrainerState, dict]:
    """Restore engine, RNG and return (trainer state, this rank's data-loader state). ``path`` comes from
    :func:`resolve_resume` (verified); every state file is read with weights_only=True."""
    check_same_shapes(saved_config(path).model, cfg.model, f"checkpoint {path}")
    state = read_trainer_state(path)
    check_tokenizer(path, state, cfg, tokenizer_sha256)
    layout = (dist.get_world_size(), cfg.parallel.tensor_parallel, engine.zero_optimization_stage())
    if (state.world_size, state.tensor_parallel, state.zero_stage) != layout:
        raise ConfigError(
            f"checkpoint {path} was written with world size, tensor_parallel, zero_stage = "
            f"{(state.world_size, state.tensor_parallel, state.zero_stage)}, this run has {layout}; exact resume "
            "needs the same layout (training/elastic.py resumes on another one)")
    own = safe_load(path / f"rank_{dist.get_rank():05d}.pt")  # (before the engine: cheap, and checks the file)
    engine.checkpoint_engine = _safe_checkpoint_engine(engine._config)  # (its parsed DeepSpeed config)
    loaded, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if loaded is None:
        raise ConfigError(f"DeepSpeed could not load checkpoint {path}")
    set_rng_state(own["rng"])
    return state, own["loader"]


def load_weights(path: str | Path, model_cfg: ModelConfig | None = None) -> tuple[RunConfig, dict[str, torch.Tensor]]:
    """Consolidated weights of a checkpoint directory (a step directory, or a run's checkpoints directory),
    its files verified against the manifest first (:data:`WEIGHTS_FILES`; a damaged one is an error)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if (path / "latest").is_file() and not (path / COMPLETE).is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise ConfigError(f"{path}: its `latest` checkpoint is incomplete or missing")
        path = found
    if not (path / COMPLETE).is_file() or not (path / WEIGHTS).is_file():
        raise ConfigError(f"{path} is not a complete checkpoint (expected {COMPLETE} and {WEIGHTS})")
    verify_checkpoint(path, only=WEIGHTS_FILES)
    saved = saved_config(path)
    if model_cfg is not None:
        check_same_shapes(saved.model, model_cfg, f"init_from={path}")
    try:
        return saved, load_file(str(path / WEIGHTS))
    except (SafetensorError, OSError, ValueError) as err:
        raise CheckpointDamaged(path, WEIGHTS, f"unreadable ({str(err)[:200]})") from None


def write_weights_checkpoint(out: str | Path, cfg: RunConfig, weights: dict[str, torch.Tensor],
                             tokenizer: str | Path | None = None) -> Path:
    """A weights-only checkpoint directory (model.safetensors, config.yaml, tokenizer.json, COMPLETE with the
    manifest of its files) that eval, generate, export and init_from read like a training checkpoint's; written
    under a temporary name and renamed when complete, replacing ``out``."""
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stored, seen = {}, set()
    for name, tensor in weights.items():  # safetensors stores no two tensors of one storage (tied weights, views)
        storage = tensor.untyped_storage().data_ptr()
        stored[name] = tensor.contiguous() if storage not in seen else tensor.clone()
        seen.add(storage)
    save_safetensors(stored, tmp / WEIGHTS)
    (tmp / "config.yaml").write_text(dump_config(cfg))
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    write_manifest(tmp)  # COMPLETE, listing every file
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
