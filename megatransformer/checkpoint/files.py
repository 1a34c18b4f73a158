"""What a checkpoint holds besides DeepSpeed's states, read and written without DeepSpeed: the trainer state,
the run config, and the consolidated weights (safetensors) that fine-tuning, evaluation and export read."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    model_serializer,
    model_validator,
)

from megatransformer.checkpoint.directory import (
    COMPLETE,
    CONFIG,
    TOKENIZER,
    TRAINER_STATE,
    WEIGHTS,
    WEIGHTS_FILES,
    find_checkpoint,
    replaced_when_written,
    step_of,
)
from megatransformer.checkpoint.integrity import (
    CheckpointDamaged,
    agreed,
    hashing_share,
    read_manifest,
    verify_checkpoint,
    verify_files,
    write_manifest,
)
from megatransformer.checkpoint.weights_files import (
    SHARD_BYTES,
    WEIGHTS_INDEX,
    WeightsFiles,
    is_weights_file,
    weights_file_names,
    write_weights_files,
)
from megatransformer.config import ConfigError, ModelConfig, RunConfig, dump_config, validate, without_retired

# Fields that change parameter shapes or names: they must match to load weights.
SHAPE_FIELDS = (
    "arch",
    "d_model",
    "n_layers",
    "n_decoder_layers",
    "n_heads",
    "n_kv_heads",
    "d_ff",
    "vocab_size",
    "norm",
    "norm_position",
    "position",
    "ffn",
    "bias",
    "tie_embeddings",
    "share_embeddings",
    "final_norm",
)
# Fields that change how the model is computed, never what: the same function whatever their values.
HOW_NOT_WHAT = ("init_std", "depth_scaled_init", "activation_checkpointing", "mlp_tiles", "attention_backend")


RowRange = Annotated[list[NonNegativeInt], Field(min_length=2, max_length=2)]
"""Global rows [start, stop)."""


class SpikeState(BaseModel):
    """The loss-spike ladder's state (training/observability/spikes.py): the detectors' recent accepted values, the
    steps of recent spikes, the rollbacks so far and the global rows each of them skips."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    losses: list[float] = []
    grad_norms: list[float] | None = None  # None: the gradient norm is not judged
    recent: list[NonNegativeInt] = []
    rollbacks: NonNegativeInt = 0
    skip_rows: list[RowRange] = []

    @model_validator(mode="after")
    def _one_row_range_per_rollback(self) -> SpikeState:
        if any(start >= stop for start, stop in self.skip_rows):
            raise ValueError("skip_rows holds a range [start, stop) with start >= stop")
        if len(self.skip_rows) != self.rollbacks:
            raise ValueError(f"{self.rollbacks} rollbacks but {len(self.skip_rows)} skipped row ranges")
        return self

    @model_serializer(mode="wrap")
    def _unjudged_norms_left_out(self, dump: Callable[[SpikeState], dict[str, Any]]) -> dict[str, Any]:
        record = dump(self)
        if self.grad_norms is None:
            del record["grad_norms"]
        return record

    def ladder_state(self) -> dict[str, Any]:
        """As ``SpikeLadder`` takes and gives it."""
        return self.model_dump()


class DecayOrigin(BaseModel):
    """Where a decay branched with schedule.decay_from began: the checkpoint it continued (resolved once, at the
    branch's first start) and its step, the decay's first."""

    model_config = ConfigDict(extra="forbid", strict=True)

    checkpoint: str
    step: NonNegativeInt


class TrainerState(BaseModel):
    """trainer.json: where a run stands and the layout that wrote it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    step: NonNegativeInt
    tokens: NonNegativeInt
    bad_steps: NonNegativeInt
    tokenizer_sha256: str | None
    world_size: PositiveInt
    tensor_parallel: PositiveInt
    sequence_parallel: PositiveInt = 1
    zero_stage: Literal[0, 1, 2, 3]
    spikes: SpikeState = Field(default_factory=SpikeState)
    schedule_phase: Literal["warmup", "stable", "decay"] | None = None  # None: written before it was recorded
    """The learning-rate schedule's phase at this step (training/optimizers/schedules.py schedule_phase)."""
    decay_from: DecayOrigin | None = None
    """A decay branch's start (schedule.decay_from), kept by every checkpoint of the branch."""

    @model_validator(mode="after")
    def _spikes_before_this_step(self) -> TrainerState:
        if any(step > self.step for step in self.spikes.recent):
            raise ValueError(f"spikes.recent names steps after step {self.step}")
        return self


def read_file(path: Path, name: str, parse: Callable[[str], Any]) -> Any:
    """``parse`` of a text file of a checkpoint; an error in it names the file (a checkpoint without a
    manifest is read unverified)."""
    try:
        return parse((path / name).read_text())
    except ConfigError as err:  # (a config.yaml this version does not accept)
        raise CheckpointDamaged(path, name, str(err)) from None
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(map(str, first["loc"])) or "the record"
        raise CheckpointDamaged(path, name, f"{where}: {first['msg']}") from None
    except (OSError, UnicodeDecodeError, ValueError, TypeError, yaml.YAMLError) as err:
        raise CheckpointDamaged(path, name, f"unreadable ({err.__class__.__name__})") from None


def read_trainer_state(path: Path) -> TrainerState:
    state = read_file(path, TRAINER_STATE, lambda text: TrainerState.model_validate(json.loads(text)))
    if step_of(path) not in (None, state.step):
        raise CheckpointDamaged(path, TRAINER_STATE, f"says step {state.step}, its directory step {step_of(path)}")
    return state


def write_trainer_state(path: Path, state: TrainerState) -> None:
    (path / TRAINER_STATE).write_text(json.dumps(state.model_dump(), indent=2))


def saved_config(path: Path) -> RunConfig:
    return read_file(path, CONFIG, lambda text: validate(without_retired(yaml.safe_load(text))))


def shape_differences(saved: ModelConfig, current: ModelConfig) -> list[str]:
    """The fields whose values differ and change the weights' shapes or names (max_seq_len: a learned table)."""
    learned = "learned" in (saved.position, current.position)
    fields = SHAPE_FIELDS + (("max_seq_len",) if learned else ())
    return [f for f in fields if getattr(saved, f) != getattr(current, f)]


def computation_differences(saved: ModelConfig, current: ModelConfig) -> list[str]:
    """``model.X=now (then there)`` for each other field whose values differ and change what the model computes."""
    fields = [f for f in ModelConfig.model_fields if f not in HOW_NOT_WHAT]
    return [
        f"model.{f}={getattr(current, f)} ({getattr(saved, f)} there)"
        for f in fields
        if getattr(saved, f) != getattr(current, f)
    ]


def check_same_shapes(saved: ModelConfig, current: ModelConfig, what: str) -> None:
    diffs = [
        f"model.{f}: {getattr(saved, f)} in the checkpoint, {getattr(current, f)} now"
        for f in shape_differences(saved, current)
    ]
    if diffs:
        raise ConfigError(f"{what} has another model shape: " + "; ".join(diffs))


# ------------------------------------------------------------------------------------ weights


class LazyWeights(Mapping[str, torch.Tensor]):
    """A checkpoint's weights by name, each read whole (in fp32 from shards; as stored from a weights checkpoint's
    files) only when looked up and not kept: a rank that writes a few of them reads only those."""

    def __init__(self, path: Path) -> None:
        from megatransformer.checkpoint.sharded import INDEX, ShardedState

        self.path = path
        self.sharded = ShardedState(path) if (path / INDEX).is_file() else None
        self.files = None if self.sharded is not None else WeightsFiles(path, weights_file_names(path))
        self.names = self.sharded.names() if self.sharded is not None else list(self.files)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.names:
            raise KeyError(name)
        if self.sharded is not None:
            return self.sharded.tensor(name)
        return self.files[name]

    def flat(
        self, name: str, start: int, stop: int, dim: int | None = None, index: int = 0, parts: int = 1
    ) -> torch.Tensor:
        """Elements ``start`` to ``stop`` (flattened) of part ``index`` of ``parts`` equal ones of tensor ``name``
        along ``dim`` (the whole tensor: None), reading only the rows that hold them (from shards: in fp32, whatever
        the layout they were saved in; from a weights checkpoint: as stored)."""
        if name not in self.names:
            raise KeyError(name)
        if self.sharded is None:
            return self.files.flat(name, start, stop, dim, index, parts)
        from megatransformer.checkpoint.sharded import MASTER

        if dim is None:
            index, parts = 0, 1
        stored = self.sharded.aliases.get(name, name)
        return self.sharded.slice_of(stored, MASTER, index, parts, dim, start, stop)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def load_state(
    model: torch.nn.Module,
    weights: Mapping[str, torch.Tensor],
    load: Callable[[torch.Tensor, Mapping[str, torch.Tensor], str], object] | None = None,
) -> None:
    """``model``'s state from ``weights`` (names to tensors, perhaps read on lookup, :class:`LazyWeights`) one tensor
    at a time, a tied one once, each by ``load(tensor, weights, name)`` (default: copied in, cast to its dtype and
    device); tensors on the meta device are left as they are. A missing or an extra name is an error."""
    state = model.state_dict(keep_vars=True)
    missing, extra = sorted(set(state) - set(weights)), sorted(set(weights) - set(state))
    if missing or extra:
        raise ValueError(f"the weights do not fit the model: missing {missing[:3]}, unexpected {extra[:3]}")
    done: set[int] = set()
    with torch.no_grad():
        for name, tensor in state.items():
            if id(tensor) not in done and not tensor.is_meta:
                if load is None:
                    tensor.copy_(weights[name])
                else:
                    load(tensor, weights, name)
            done.add(id(tensor))


def check_weights(
    path: str | Path, model_cfg: ModelConfig | None = None, what: str = "checkpoint"
) -> tuple[Path, RunConfig, list[str]]:
    """Every check of :func:`load_weights` but the hashing of the files that hold the weights (the shards, or the
    weights' files), which are checked for their presence and size: seconds, whatever the model's size. The
    checkpoint ``path`` means, its config, and those files."""
    from megatransformer.checkpoint.sharded import INDEX

    path = find_checkpoint(path, what)
    if (path / INDEX).is_file():
        verify_checkpoint(path, only=(CONFIG, TOKENIZER, INDEX))
        data = [name for name in read_manifest(path) or {} if name.startswith("shard_")]
    elif (path / WEIGHTS).is_file() or (path / WEIGHTS_INDEX).is_file():
        verify_checkpoint(path, only=(CONFIG, TOKENIZER, WEIGHTS_INDEX))
        data = weights_file_names(path)
    else:
        raise ConfigError(
            f"{what}: {path} is not a complete checkpoint (expected {COMPLETE} and {INDEX}, {WEIGHTS} or "
            f"{WEIGHTS_INDEX})"
        )
    verify_files(path, data, hashed=False)
    saved = saved_config(path)
    if model_cfg is not None:
        check_same_shapes(saved.model, model_cfg, f"{what} {path}")
    return path, saved, data


def load_weights(
    path: str | Path,
    model_cfg: ModelConfig | None = None,
    what: str = "checkpoint",
    lazy: bool = False,
    shared: bool = False,
) -> tuple[RunConfig, Mapping[str, torch.Tensor]]:
    """Config and whole weights of the checkpoint ``path`` means (:func:`find_checkpoint`): a training
    checkpoint's shards assembled one tensor at a time in fp32, or a weights checkpoint's files as stored; the
    files read are verified against the manifest first (a damaged one is an error). ``lazy``: as
    :class:`LazyWeights`, each tensor read when looked up (a dict of them all otherwise). ``shared``: every rank of
    the process group loads the checkpoint, and each file of the weights is hashed by one of them
    (:func:`hashing_share`), every rank raising the same error should any rank find damage (:func:`agreed`):
    a collective."""
    from megatransformer.checkpoint.sharded import INDEX, ShardedState

    def check() -> tuple[Path, RunConfig]:
        directory, saved, data = check_weights(path, model_cfg, what)
        verify_files(directory, hashing_share(directory, data) if shared else data)
        return directory, saved

    path, saved = agreed(check) if shared else check()
    if lazy:
        return saved, LazyWeights(path)
    if (path / INDEX).is_file():
        return saved, dict(ShardedState(path).weights())
    return saved, dict(LazyWeights(path).items())


def write_weights_checkpoint(
    out: str | Path,
    cfg: RunConfig,
    weights: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    tokenizer: str | Path | None = None,
    dtype: torch.dtype | None = None,
    shard_bytes: int = SHARD_BYTES,
) -> Path:
    """A weights-only checkpoint directory (the weights' files, config.yaml, tokenizer.json, COMPLETE with the
    manifest of its files) that eval, generate, export and init_from read like a training checkpoint's; written
    under a temporary name and renamed when complete, replacing ``out``. ``weights``: a mapping (one that reads
    each tensor when looked up, :class:`LazyWeights`, is read a tensor at a time) or (name, tensor) pairs, each
    taken when the last is written; ``dtype``: what they are stored in (as given: None); ``shard_bytes``: the
    most one file holds (:func:`write_weights_files`)."""
    out = Path(out)
    pairs = weights.items() if isinstance(weights, Mapping) else weights
    with replaced_when_written(out, lambda name: name in (*WEIGHTS_FILES, COMPLETE) or is_weights_file(name)) as tmp:
        write_weights_files(tmp, ((name, t if dtype is None else t.to(dtype)) for name, t in pairs), shard_bytes)
        (tmp / CONFIG).write_text(dump_config(cfg))
        if tokenizer is not None and Path(tokenizer).is_file():
            shutil.copyfile(tokenizer, tmp / TOKENIZER)
        for file in tmp.iterdir():  # (durable before the manifest that vouches for them)
            with open(file, "rb") as f:
                os.fsync(f.fileno())
        write_manifest(tmp)  # COMPLETE, listing every file
    return out
