"""Sharded checkpoints written without DeepSpeed, as ranks of a given layout would write them."""

from __future__ import annotations

import json

import torch

from megatransformer.checkpoint import sharded
from megatransformer.checkpoint.sharded import ParamLayout, Piece


def write_checkpoint(path, full: dict[str, torch.Tensor], tp: int, dp: int, tp_dims: dict[str, int | None], save="s"):
    """``full`` saved as ``tp`` x ``dp`` ranks would: each tensor-parallel slice split into ``dp`` flat ranges,
    rank (t, d) writing slice t's range d; returns the index."""
    path.mkdir(parents=True, exist_ok=True)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    params = {}
    for name, tensor in full.items():
        dim = tp_dims[name]
        slices = tensor.chunk(tp, dim) if dim is not None else [tensor]
        pieces = []
        for t, part in enumerate(slices):
            flat = part.reshape(-1)
            for d in range(dp):
                lo, hi = flat.numel() * d // dp, flat.numel() * (d + 1) // dp
                file = sharded.shard_file(t * dp + d)
                for kind, scale in (("fp32", 1.0), ("exp_avg", 2.0)):
                    key = sharded.piece_key(kind, name, t, lo)
                    shards.setdefault(file, {})[key] = (flat[lo:hi] * scale).clone()
                pieces.append(Piece(t, lo, hi, file))
        layout = ParamLayout(tuple(tensor.shape), dim, tp if dim is not None else 1, tuple(pieces))
        sharded.check_cover(name, layout)
        params[name] = layout
    for file, tensors in shards.items():
        sharded.write_safetensors(path / file, tensors, {"save": save, "step": "5"})
    record = sharded.index_record(params, ["fp32", "exp_avg"], {"tied.weight": "w"}, save, 5)
    (path / sharded.INDEX).write_text(json.dumps(record))
