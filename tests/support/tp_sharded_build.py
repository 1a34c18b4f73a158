"""One rank of a ZeRO-3 build with tensor parallelism under ``torchrun`` (``python -m support.tp_sharded_build OUT``):
tensor_parallel 2 over 4 ranks (2 data-parallel ranks), the model built and handed to ``deepspeed.initialize`` as the
engine does (construction.py), in fp32 and bf16. Written to OUT/rank_<r>.json: the parameters left whole by the build,
those whose gathered values are not this rank's slices of the one-rank build, before and after weights are loaded
(init_from), the most bytes its parameters held at once and torch's host allocator's peak over the build and AutoTP's
slicing, the bytes of its partition and of a layer."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import deepspeed
import torch

from megatransformer.checkpoint import SHARD_BYTES
from megatransformer.config import precision_dtype
from megatransformer.model import build_model
from megatransformer.training.engine.construction import build_for_run, slices_made_by_autotp
from megatransformer.training.engine.train_module import deepspeed_config
from megatransformer.training.runtime.distributed import setup
from megatransformer.training.runtime.layout import BatchSizes
from support.memory import peak_host_bytes
from support.models import run_config
from support.sharded_build import ParameterBytes
from support.tp_build import MODEL, a_fifth, differing, loaded

TP = 2


def engine_module(cfg, config: dict, weights=None) -> torch.nn.Module:
    """The model as ``TrainModule`` builds it and hands it to DeepSpeed (its AutoTP), without training it."""
    model = build_for_run(cfg, 3, config)
    with slices_made_by_autotp(model, cfg, "cpu", weights):
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine.module


def main(out: Path) -> None:
    from deepspeed.utils import groups

    info = setup()
    record: dict = {"world": info.world_size}
    for precision in ("fp32", "bf16"):
        cfg = run_config(model=MODEL, precision=precision, seed=11, parallel={"zero_stage": 3, "tensor_parallel": TP})
        config = deepspeed_config(cfg, BatchSizes(1, 1, info.world_size // TP), "cpu", zero_stage=3)
        del config["optimizer"]  # (the parameters alone: no optimizer's states)
        dtype = precision_dtype(precision)
        engine_module(cfg, config)  # (once before counting: DeepSpeed's first-use allocations)
        built = build_for_run(cfg, 3, config)  # (before AutoTP: the linear layers' weights on the meta device)
        record[f"whole_after_build_{precision}"] = [
            name for name, p in built.named_parameters() if not p.is_meta and not hasattr(p, "ds_tensor")
        ]
        del built
        counter = ParameterBytes()
        with counter:
            module = engine_module(cfg, config)
        rank = groups.get_tensor_model_parallel_rank()
        reference = build_model(cfg.model, cfg.seed)
        record[f"differing_{precision}"] = differing(module, reference, dtype, rank, TP)
        record[f"held_{precision}"] = counter.most
        record[f"broadcasts_{precision}"] = counter.broadcasts
        record[f"partition_{precision}"] = sum(p.ds_tensor.nbytes for p in module.parameters())
        # the largest module a rank may hold whole at once: an embedding table, a block, the output head
        parts = [*reference.decoder.layers, reference.embed_tokens, reference.lm_head]
        record[f"layer_{precision}"] = max(sum(p.numel() for p in part.parameters()) for part in parts) * dtype.itemsize
        record[f"whole_{precision}"] = sum(p.numel() for p in reference.parameters()) * dtype.itemsize
        record[f"peak_{precision}"] = peak_host_bytes(lambda: engine_module(cfg, config), python=False)
        # weights a run starts from (init_from): a weights checkpoint, read tensor by tensor or slice by slice
        files = SHARD_BYTES if precision == "fp32" else a_fifth(reference)  # (one file, or files of a fifth)
        got = loaded(lambda r: engine_module(cfg, config, r), cfg, reference, out / f"weights_{precision}", TP, files)
        record |= {f"{key}_{precision}": value for key, value in got.items()}
    (out / f"rank_{info.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
