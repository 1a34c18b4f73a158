"""One rank of a tensor-parallel build under ``torchrun`` (``python -m support.tp_build OUT``): the model built with
tensor_parallel = world size and handed to ``deepspeed.initialize`` as the engine does (construction.py), at ZeRO-0
(stage 1 on one data-parallel rank) and ZeRO-3, in fp32 and bf16. Written to OUT/rank_<r>.json: the parameters
whose values are not this rank's slices of the one-rank build, before and after weights are loaded (init_from,
from a weights checkpoint: which tensors were read whole and which as slices), the bytes torch's host allocator
held at its peak over the build and AutoTP's sharding, and the model's sizes."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import deepspeed
import torch

from megatransformer.checkpoint import SHARD_BYTES, write_weights_checkpoint
from megatransformer.checkpoint.files import LazyWeights
from megatransformer.config import precision_dtype
from megatransformer.model import build_model
from megatransformer.model.tp_plan import partition_dim
from megatransformer.training.engine.construction import build_for_run, slices_made_by_autotp
from megatransformer.training.engine.train_module import deepspeed_config
from megatransformer.training.runtime.distributed import setup
from megatransformer.training.runtime.layout import BatchSizes
from support.memory import peak_host_bytes
from support.models import run_config

# sixteen thin layers: a layer is a small part of the model, so a whole model's bytes on a rank stand out
MODEL = dict(d_model=128, n_layers=16, n_heads=4, n_kv_heads=2, d_ff=256, vocab_size=256, max_seq_len=32)


class Reads(Mapping[str, torch.Tensor]):
    """``weights``, recording the names read whole and those read as a slice."""

    def __init__(self, weights: LazyWeights) -> None:
        self.weights, self.whole, self.sliced = weights, set(), set()

    def __getitem__(self, name: str) -> torch.Tensor:
        self.whole.add(name)
        return self.weights[name]

    def flat(self, name: str, start: int, stop: int, dim: int | None, index: int, parts: int) -> torch.Tensor:
        if dim is not None:  # (a slice, or a range of it: ZeRO-3's partition of it)
            self.sliced.add(name)
        return self.weights.flat(name, start, stop, dim, index, parts)

    def __iter__(self) -> Iterator[str]:
        return iter(self.weights)

    def __len__(self) -> int:
        return len(self.weights)


def loaded(
    build: Callable[[Reads], torch.nn.Module],
    cfg,
    reference: torch.nn.Module,
    path: Path,
    tp: int,
    shard_bytes: int = SHARD_BYTES,
) -> dict:
    """A build from a weights checkpoint (init_from) that rank 0 writes at ``path`` (in files of ``shard_bytes``),
    each tensor of ``reference`` given random values: the parameters whose values are not this rank's slices of it,
    the split tensors read whole and those not read as slices. ``reference`` is left holding the checkpoint's
    weights."""
    from deepspeed.utils import groups

    values: dict[int, torch.Tensor] = {}  # (a tied tensor has the same values under each of its names)
    state = reference.state_dict(keep_vars=True)
    generator = torch.Generator().manual_seed(5)  # (values that differ in every element: a misplaced read shows)
    weights = {
        n: values.setdefault(id(t), torch.randn(t.shape, generator=generator, dtype=t.dtype)) for n, t in state.items()
    }
    if torch.distributed.get_rank() == 0:
        write_weights_checkpoint(path, cfg, weights, shard_bytes=shard_bytes)
    torch.distributed.barrier()
    reads = Reads(LazyWeights(path))
    module = build(reads)
    reference.load_state_dict(weights)
    rank, dtype = groups.get_tensor_model_parallel_rank(), precision_dtype(cfg.precision)
    split = sorted(n for n, _ in reference.named_parameters() if partition_dim(n) is not None)
    return {
        "differing_loaded": differing(module, reference, dtype, rank, tp),
        "split_read_whole": sorted(reads.whole & set(split)),
        "split_not_sliced": sorted(set(split) - reads.sliced),
    }


def a_fifth(model: torch.nn.Module) -> int:
    """A fifth of ``model``'s bytes: weights files that hold it in five or more."""
    return sum(t.nbytes for t in model.state_dict().values()) // 5


def engine_module(cfg, stage: int, weights=None) -> torch.nn.Module:
    """The model as ``TrainModule`` builds it and hands it to DeepSpeed (its AutoTP), without training it."""
    config = deepspeed_config(cfg, BatchSizes(1, 1, 1), "cpu", zero_stage=stage)
    model = build_for_run(cfg, stage, config)
    with slices_made_by_autotp(model, cfg, "cpu", weights):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine.module


def main(out: Path) -> None:
    from deepspeed.utils import groups

    info = setup()
    tp = info.world_size
    record: dict = {"world": tp}
    for stage in (0, 3):
        for precision in ("fp32", "bf16"):
            cfg = run_config(
                model=MODEL, precision=precision, seed=11, parallel={"zero_stage": stage, "tensor_parallel": tp}
            )
            dtype = precision_dtype(precision)
            module = engine_module(cfg, stage)
            rank = groups.get_tensor_model_parallel_rank()
            reference = build_model(cfg.model, cfg.seed)
            record[f"differing_{stage}_{precision}"] = differing(module, reference, dtype, rank, tp)
            # weights a run starts from (init_from): a weights checkpoint, read tensor by tensor or slice by slice,
            # from one file (fp32) or from files of a fifth of the model (bf16)
            files = SHARD_BYTES if precision == "fp32" else a_fifth(reference)
            got = loaded(lambda reads: engine_module(cfg, stage, reads), cfg, reference, out / "weights", tp, files)
            record |= {f"{key}_{stage}_{precision}": value for key, value in got.items()}
            torch.distributed.barrier()
    cfg = run_config(model=MODEL, precision="fp32", seed=11, parallel={"zero_stage": 0, "tensor_parallel": tp})
    module = engine_module(cfg, 0)
    record["shard"] = sum(p.nbytes for p in module.parameters())
    # the largest module a rank may hold whole at once: an embedding table, a block, the output head (fp32)
    parts = [*reference.decoder.layers, reference.embed_tokens, reference.lm_head]
    record["layer"] = max(sum(p.numel() for p in part.parameters()) for part in parts) * 4
    record["whole"] = sum(p.nbytes for p in build_model(cfg.model, cfg.seed).parameters())
    record["peak"] = peak_host_bytes(lambda: engine_module(cfg, 0), python=False)
    record["whole_build"] = peak_host_bytes(lambda: build_model(cfg.model, cfg.seed), python=False)
    (out / f"rank_{info.rank}.json").write_text(json.dumps(record))


def differing(module: torch.nn.Module, reference: torch.nn.Module, dtype, rank: int, tp: int) -> list[str]:
    """The names of ``module``'s parameters (ZeRO-3's gathered) whose values are not tensor-parallel rank ``rank``'s
    slices of ``reference``'s in ``dtype``."""
    params = dict(module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values())):  # (nothing to gather below ZeRO-3)
        differing = []
        for name, param in params.items():
            whole = reference.get_parameter(name).detach().to(dtype)
            dim = partition_dim(name)
            expected = whole if dim is None else whole.chunk(tp, dim)[rank]
            if param.shape != expected.shape or not torch.equal(param.data, expected):
                differing.append(name)
        return differing


if __name__ == "__main__":
    main(Path(sys.argv[1]))
