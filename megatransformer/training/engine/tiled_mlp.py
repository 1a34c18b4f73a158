"""MLPs computed in tiles of the sequence (DeepSpeed ALST's ``TiledMLP``), applied to the model from the outside
(docs/sequence_parallel.md).

The forward runs the tiles one after the other and keeps only the MLP's input; the backward recomputes one tile
at a time and sums the weights' gradients over the tiles, telling ZeRO to reduce them after the last one. The
MLP's hidden activations then live for one tile, not the whole sequence.
"""

from __future__ import annotations

import torch
from torch import nn

from megatransformer.model.compile_marks import never_compiled
from megatransformer.model.layers import FeedForward


class TiledForward:
    """``module``'s forward on [..., T, d] in ``tiles`` slices of T (one slice of the rows in the backward)."""

    def __init__(self, module: nn.Module, tiles: int) -> None:
        self.module, self.tiles = module, tiles

    @never_compiled  # (TiledMLP sets attributes on the weights: compiled graphs break around it)
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledMLP

        tiles = backward_tiles(x, self.tiles)
        return TiledMLP.apply(plain_forward, self.module, x, tiles, list(self.module.parameters()))


def backward_tiles(x: torch.Tensor, tiles: int) -> int:
    """The tiles ``torch.chunk`` makes of ``x``'s rows when asked for ``tiles``: TiledMLP's backward marks the
    gradients ready after tile number ``tiles``, so it must be asked for exactly as many as it gets."""
    rows = x.shape[:-1].numel()
    per_tile = -(-rows // tiles)
    return -(-rows // per_tile)


def plain_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return type(module).forward(module, x)


def apply_tiled_mlp(model: nn.Module, tiles: int) -> None:
    """Run every feed-forward module in ``tiles`` sequence tiles (the model's code is unchanged)."""
    for module in model.modules():
        if isinstance(module, FeedForward):
            module.forward = TiledForward(module, tiles)
