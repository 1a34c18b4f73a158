"""The MLP in sequence tiles (DeepSpeed's TiledMLP, applied by training/engine/tiled_mlp.py): the same loss and
gradients as untiled, gradients marked ready for ZeRO only after the last tile, the config's checks and the
activation estimate (ZeRO-3 and sequence parallelism end to end: tests/e2e/test_sequence_parallel.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from support.models import tiny_config

from megatransformer.config import ConfigError, load_config
from megatransformer.model import build_model
from megatransformer.model.layers import FeedForward
from megatransformer.training.engine.tiled_mlp import apply_tiled_mlp, backward_tiles


def loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor):
    loss = model(ids, labels=labels)
    loss.backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("ffn", ["swiglu", "gelu", "relu"])
@pytest.mark.parametrize("checkpointing", [False, True])
@pytest.mark.parametrize("tiles", [3, 4])
def test_tiled_training_gives_the_untiled_loss_and_gradients(ffn, checkpointing, tiles):
    torch.manual_seed(0)
    plain = build_model(tiny_config(ffn=ffn, activation_checkpointing=checkpointing, bias=True))
    tiled = copy.deepcopy(plain)
    apply_tiled_mlp(tiled, tiles)
    gen = torch.Generator().manual_seed(1)
    ids, labels = torch.randint(0, 97, (2, 2, 21), generator=gen)  # 21 positions: unequal tiles
    loss, grads = loss_and_grads(plain, ids, labels)
    tiled_loss, tiled_grads = loss_and_grads(tiled, ids, labels)
    assert tiled.state_dict().keys() == plain.state_dict().keys()
    assert torch.allclose(tiled_loss, loss, rtol=0, atol=1e-6)
    for name, grad in grads.items():  # (sums over other tiles of rows: rounding, relative to the largest entry)
        assert (tiled_grads[name] - grad).abs().max() <= 1e-5 * grad.abs().max(), name
    with torch.no_grad():  # (evaluation)
        assert torch.allclose(tiled.eval()(ids, labels=labels), plain.eval()(ids, labels=labels), rtol=0, atol=1e-6)


def test_the_whole_row_count_becomes_the_tiles_torch_chunk_makes():
    assert backward_tiles(torch.empty(2, 21, 8), 4) == 4  # 42 rows: 11, 11, 11, 9
    assert backward_tiles(torch.empty(1, 6, 8), 4) == 3  # 6 rows asked in 4: 2, 2, 2
    assert backward_tiles(torch.empty(1, 3, 8), 4) == 3


@pytest.mark.parametrize("positions", [21, 6])
def test_weight_gradients_are_ready_for_zero_only_after_the_last_tile(positions):
    """ZeRO's gradient hooks reduce a weight's gradient when it is accumulated with ``ds_grad_is_ready`` unset
    or true: the tiles' partial gradients must be accumulated with it false, the last one with it true."""
    torch.manual_seed(0)
    mlp = FeedForward(tiny_config())
    apply_tiled_mlp(mlp, 4)
    seen: dict[str, list[bool]] = {name: [] for name, _ in mlp.named_parameters()}
    for name, param in mlp.named_parameters():
        param.register_post_accumulate_grad_hook(
            lambda p, name=name: seen[name].append(getattr(p, "ds_grad_is_ready", True))
        )
    x = torch.randn(1, positions, 32, requires_grad=True)
    mlp(x).square().sum().backward()
    tiles = backward_tiles(x, 4)
    assert all(flags == [False] * (tiles - 1) + [True] for flags in seen.values()), seen


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model.mlp_tiles=0"], "model.mlp_tiles"),
        (
            ["model.mlp_tiles=2", "model.dropout=0.1"],
            "model.mlp_tiles=2 recomputes the MLP in the backward pass, which would draw other dropout masks",
        ),
        (
            ["model.mlp_tiles=65", "data.seq_len=128", "parallel.sequence_parallel=2"],
            "model.mlp_tiles=65 exceeds the 64 positions of a sequence each rank holds",
        ),
    ],
)
def test_tile_counts_that_cannot_work_give_one_precise_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_the_estimate_keeps_no_hidden_activations_of_tiled_mlps():
    from megatransformer.planner import Layout, activation_parts, ffn_kept

    base = ["data.seq_len=128", "model.d_ff=2048", "model.n_layers=6"]
    for checkpointing in (False, True):
        plain, tiled = (load_config(None, [*base, f"model.mlp_tiles={k}"]) for k in (1, 4))
        parts = [
            activation_parts(c, Layout(1, 1, 1, 0, checkpointing, c.model.mlp_tiles, False, 1, 1), "cpu")
            for c in (plain, tiled)
        ]
        hidden = ffn_kept(plain.model) * 128 * 4  # values of the row, fp32 bytes
        if checkpointing:  # only the block recomputed in the backward holds them
            assert parts[0]["recomputed"] - parts[1]["recomputed"] == hidden
            assert parts[0]["activations"] == parts[1]["activations"]
        else:
            assert parts[0]["activations"] - parts[1]["activations"] == 6 * hidden
