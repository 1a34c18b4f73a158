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
        config.yaml          the resolved run config
        tokenizer.json       the tokenizer the data was made with
        COMPLETE             written after every rank finished: only then does `latest` point here

A run killed during a save leaves a directory without COMPLETE, and `latest` still names the previous one.

What can change between runs:
- resume (exact continuation): nothing that shapes the state: the same world size, tensor_parallel and
  zero_stage (DeepSpeed's optimizer shards and our per-rank loader/RNG states are per rank), the same model
  shape (a mismatch is an error listing the fields) and the same tokenizer (sha256 in trainer.json).
- init_from (fine-tuning) and ``megatransformer export`` read only model.safetensors, which holds the whole
  model: ZeRO-3 partitions are gathered and tensor-parallel shards concatenated (along TP_PLAN's split
  dimension) when it is written. So any change of data-parallel size and ZeRO stage, and any change of
  tensor-parallel size that divides the heads, kv-heads, d_ff and vocabulary, is supported: the new run's
  AutoTP splits the full weights again, and they carry no trace of the source's TP size (tests: TP 2 -> 1
  and 2 -> 2 across ZeRO stages, and the TP=2 file equal to the TP=1 run's, in tests/test_train_weights.py).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import yaml

from megatransformer.config import ConfigError, ModelConfig, RunConfig, dump_config, validate
from megatransformer.model.tp_plan import TP_PLAN

COMPLETE = "COMPLETE"
WEIGHTS = "model.safetensors"
# Fields that change parameter shapes or names: they must match to load weights.
SHAPE_FIELDS = ("arch", "d_model", "n_layers", "n_decoder_layers", "n_heads", "n_kv_heads", "d_ff", "vocab_size",
                "norm", "norm_position", "position", "ffn", "bias", "tie_embeddings", "share_embeddings",
                "final_norm")


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def checkpoint_root(cfg: RunConfig) -> Path:
    return Path(cfg.run_dir) / "checkpoints"


def latest_checkpoint(root: Path) -> Path | None:
    """The checkpoint `latest` names; should that be gone (deleted by hand), the newest complete one."""
    pointer = root / "latest"
    if pointer.is_file() and (root / pointer.read_text().strip() / COMPLETE).is_file():
        return root / pointer.read_text().strip()
    complete = sorted(p for p in root.glob("step_*") if (p / COMPLETE).is_file())
    return complete[-1] if complete else None


def resolve_resume(cfg: RunConfig) -> Path | None:
    """The checkpoint to resume from: ``auto`` -> latest complete one or None (fresh start); a path must exist."""
    if cfg.resume is None:
        return None
    if cfg.resume == "auto":
        return latest_checkpoint(checkpoint_root(cfg))
    path = Path(cfg.resume)
    if (path / "latest").is_file():  # a checkpoints directory
        found = latest_checkpoint(path)
        if found is None:
            raise ConfigError(f"resume={cfg.resume}: its `latest` checkpoint is incomplete or missing")
        return found
    if not (path / COMPLETE).is_file():
        raise ConfigError(f"resume={cfg.resume} is not a complete checkpoint directory (no {COMPLETE} marker); "
                          "use resume=auto to take the latest complete one")
    return path


def saved_config(path: Path) -> RunConfig:
    return validate(yaml.safe_load((path / "config.yaml").read_text()))


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

    is_main, tp = dist.get_rank() == 0, cfg.parallel.tensor_parallel
    masters = _fp16_optimizer_masters(engine.optimizer)
    state: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor | None] = {}  # tied weights appear under two names: gathered once
    for name, tensor in engine.module.state_dict(keep_vars=True).items():
        tied = id(tensor) in done
        if not tied:
            full = safe_get_full_fp32_param(tensor) if isinstance(tensor, torch.nn.Parameter) else None
            full = masters.get(id(tensor), tensor) if full is None else full
            full = full.detach().float()
            dim = _partition_dim(name) if tp > 1 else None
            if dim is not None:
                full = _gather_shards(full, dim, tp)
            done[id(tensor)] = full.cpu().clone() if is_main else None
        if is_main:  # (safetensors stores no two names for one storage)
            state[name] = done[id(tensor)].clone() if tied else done[id(tensor)]
    return state if is_main else None


def _partition_dim(name: str) -> int | None:
    weight = re.sub(r"\.bias$", ".weight", name)
    for pattern, kind in TP_PLAN.items():
        if re.match(pattern, weight):
            if name.endswith(".bias"):
                return 0 if kind == "column" else None
            return 0 if kind == "column" else 1
    return None


def _fp16_optimizer_masters(optimizer) -> dict[int, torch.Tensor]:
    """bf16/fp16 without ZeRO: DeepSpeed's FP16_Optimizer / FP16_UnfusedOptimizer keep fp32 masters (one
    flat tensor, or one tensor per parameter, per group) that ``safe_get_full_fp32_param`` does not know
    about; map each low-precision parameter to its master."""
    from torch._utils import _unflatten_dense_tensors

    low = getattr(optimizer, "fp16_groups", None)
    if low is None:
        return {}
    if hasattr(optimizer, "fp32_groups_flat"):
        high = [_unflatten_dense_tensors(flat, params) for flat, params in zip(optimizer.fp32_groups_flat, low)]
    else:
        high = getattr(optimizer, "fp32_groups", [])
    return {id(p): master for params, masters in zip(low, high) for p, master in zip(params, masters)}


def _gather_shards(shard: torch.Tensor, dim: int, tp: int) -> torch.Tensor:
    from deepspeed.utils import groups

    pieces = [torch.empty_like(shard) for _ in range(tp)]
    dist.all_gather(pieces, shard.contiguous(), group=groups.get_tensor_model_parallel_group())
    return torch.cat(pieces, dim=dim)


def save_checkpoint(engine, cfg: RunConfig, state: TrainerState, loader_state: dict,
                    tokenizer_path: str | None) -> Path:
    from safetensors.torch import save_file

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
    if rank == 0:
        save_file(weights, str(path / WEIGHTS), metadata={"format": "pt"})
        (path / "trainer.json").write_text(json.dumps(state.__dict__, indent=2))
        (path / "config.yaml").write_text(dump_config(cfg))
        if tokenizer_path:
            shutil.copyfile(tokenizer_path, path / "tokenizer.json")
    dist.barrier()
    if rank == 0:
        (path / COMPLETE).touch()
        _atomic_write(root / "latest", tag)
        _prune(root, cfg.checkpoint.keep, keep=tag)
    dist.barrier()
    return path


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _prune(root: Path, keep_last: int, keep: str) -> None:
    steps = sorted(p for p in root.glob("step_*") if (p / COMPLETE).is_file())
    for old in steps[:-keep_last] if keep_last > 0 else []:
        if old.name != keep:
            shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------- loading


def load_checkpoint(engine, cfg: RunConfig, path: Path,
                    tokenizer_sha256: str | None = None) -> tuple[TrainerState, dict]:
    """Restore engine, RNG and return (trainer state, this rank's data-loader state)."""
    check_same_shapes(saved_config(path).model, cfg.model, f"checkpoint {path}")
    state = TrainerState(**json.loads((path / "trainer.json").read_text()))
    if tokenizer_sha256 and state.tokenizer_sha256 and tokenizer_sha256 != state.tokenizer_sha256:
        raise ConfigError(f"checkpoint {path} was trained with another tokenizer (sha256 "
                          f"{state.tokenizer_sha256[:12]}, data.tokenizer={cfg.data.tokenizer} has "
                          f"{tokenizer_sha256[:12]}); resume with the same tokenizer, or start a new run "
                          "with init_from=")
    layout = (dist.get_world_size(), cfg.parallel.tensor_parallel, cfg.parallel.zero_stage)
    if (state.world_size, state.tensor_parallel, state.zero_stage) != layout:
        raise ConfigError(
            f"checkpoint {path} was written with world size, tensor_parallel, zero_stage = "
            f"{(state.world_size, state.tensor_parallel, state.zero_stage)}, this run has {layout}; exact resume "
            "needs the same layout (start a new run from its weights with init_from= instead)")
    loaded, _ = engine.load_checkpoint(str(path.parent), tag=path.name, load_optimizer_states=True,
                                       load_lr_scheduler_states=True)
    if loaded is None:
        raise ConfigError(f"DeepSpeed could not load checkpoint {path}")
    own = torch.load(path / f"rank_{dist.get_rank():05d}.pt", weights_only=True)
    set_rng_state(own["rng"])
    return state, own["loader"]


def load_weights(path: str | Path, model_cfg: ModelConfig | None = None) -> tuple[RunConfig, dict[str, torch.Tensor]]:
    """Consolidated weights of a checkpoint directory (a step directory, or a run's checkpoints directory)."""
    from safetensors.torch import load_file

    path = Path(path)
    if (path / "latest").is_file():
        found = latest_checkpoint(path)
        if found is None:
            raise ConfigError(f"{path}: its `latest` checkpoint is incomplete or missing")
        path = found
    if not (path / COMPLETE).is_file() or not (path / WEIGHTS).is_file():
        raise ConfigError(f"{path} is not a complete checkpoint (expected {COMPLETE} and {WEIGHTS})")
    saved = saved_config(path)
    if model_cfg is not None:
        check_same_shapes(saved.model, model_cfg, f"init_from={path}")
    return saved, load_file(str(path / WEIGHTS))


def write_weights_checkpoint(out: str | Path, cfg: RunConfig, weights: dict[str, torch.Tensor],
                             tokenizer: str | Path | None = None) -> Path:
    """A weights-only checkpoint directory (model.safetensors, config.yaml, tokenizer.json, COMPLETE) that
    eval, generate, export and init_from read like a training checkpoint's; written under a temporary name and
    renamed when complete, replacing ``out``."""
    from safetensors.torch import save_file

    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stored, seen = {}, set()
    for name, tensor in weights.items():  # safetensors stores no two tensors of one storage (tied weights, views)
        storage = tensor.untyped_storage().data_ptr()
        stored[name] = tensor.contiguous() if storage not in seen else tensor.clone()
        seen.add(storage)
    save_file(stored, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / "config.yaml").write_text(dump_config(cfg))
    if tokenizer is not None and Path(tokenizer).is_file():
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
    (tmp / COMPLETE).touch()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
