"""The memory bound of sharded checkpoints: no rank's host memory during a save or a load goes above its shard
plus 1.2x the largest parameter, on the layout that wrote the checkpoint or another; measured with torch's
allocator events (support.memory), on a model with one large parameter. Gathering the whole state exceeds it."""

from __future__ import annotations

import math

import pytest
import torch
from support.checkpoints import write_checkpoint
from support.memory import peak_host_bytes

from megatransformer.checkpoint import sharded
from megatransformer.checkpoint.sharded import ShardedState

FULL = {
    "big": torch.randn(256, 512),  # 512 KiB: the largest parameter
    "w": torch.randn(256, 128),
    "b": torch.randn(256),
    "v": torch.randn(128, 256),
}
DIMS = {"big": 1, "w": 0, "b": None, "v": 1}
BOUND = 1.2 * FULL["big"].numel() * 4  # (beyond the rank's shard, which the engine holds already)


def rank_slices(tp: int, dp: int, t: int, d: int) -> list[tuple[str, int, int, int | None, int, int]]:
    """What rank (t, d) of a tp x dp layout holds of each parameter: (name, tp_index, tp, dim, start, stop)."""
    slices = []
    for name, tensor in FULL.items():
        dim = DIMS[name] if tp > 1 else None
        numel = tensor.numel() // (tp if dim is not None else 1)
        slices.append((name, t if dim is not None else 0, tp, dim, numel * d // dp, numel * (d + 1) // dp))
    return slices


def test_the_measure_sees_a_copy_and_a_concatenation():
    x = torch.randn(1_000_000)
    assert 4e6 <= peak_host_bytes(lambda: x.clone().sum()) < 1.01 * 4e6
    assert 16e6 <= peak_host_bytes(lambda: torch.cat([x, x]).add(1).sum()) < 1.01 * 16e6
    assert 4e6 <= peak_host_bytes(lambda: bytes(4_000_000)) < 1.01 * 4e6  # (Python's own allocations)


@pytest.mark.parametrize("now", [(2, 2), (1, 1), (1, 3), (4, 1), (2, 3)], ids=lambda n: f"tp{n[0]}xdp{n[1]}")
def test_a_load_on_any_layout_takes_at_most_1_2x_the_largest_parameter_beyond_the_shard(tmp_path, now):
    write_checkpoint(tmp_path, FULL, 2, 2, DIMS)
    tp, dp = now
    for t in range(tp):
        for d in range(dp):
            slices = rank_slices(tp, dp, t, d)
            shard = {where: torch.empty(where[-1] - where[-2]) for where in slices}  # (the engine's, held already)

            def load(slices=slices, shard=shard):
                state = ShardedState(tmp_path)
                for name, *where in slices:
                    for kind in ("fp32", "exp_avg"):
                        shard[(name, *where)].copy_(state.slice_of(name, kind, *where))

            assert peak_host_bytes(load) <= BOUND, (t, d)
            for (name, tp_index, _, dim, start, stop), tensor in shard.items():  # (the exp_avg, twice the weights)
                part = FULL[name].chunk(tp, dim)[tp_index] if dim is not None else FULL[name]
                assert torch.equal(tensor, 2 * part.reshape(-1)[start:stop]), (name, t, d)


def test_reading_the_weights_one_tensor_at_a_time_stays_within_the_bound_and_gathering_them_does_not(tmp_path):
    write_checkpoint(tmp_path, FULL, 2, 2, DIMS)

    def one_at_a_time():
        for _, tensor in ShardedState(tmp_path).weights():
            tensor.sum()
            del tensor  # (else the loop holds it while the next one is read)

    assert peak_host_bytes(one_at_a_time) <= BOUND
    gathered = peak_host_bytes(lambda: dict(ShardedState(tmp_path).weights()))  # (what a consolidating save does)
    assert gathered > BOUND and gathered >= 4 * sum(t.numel() for t in FULL.values())


def test_a_save_writes_its_shard_taking_no_more_memory_than_a_small_header(tmp_path):
    """The rank's shard staged in host memory (its shard: the copy the step waits for), then written and hashed
    straight from that memory."""
    shard = {sharded.piece_key("fp32", name, 0, 0): t.reshape(-1).clone() for name, t in FULL.items()}
    size = sum(t.numel() * 4 for t in shard.values())
    peak = peak_host_bytes(lambda: sharded.write_safetensors(tmp_path / "s.safetensors", shard, {"step": "1"}))
    assert peak <= BOUND and peak < 0.1 * size, peak
    assert math.isclose((tmp_path / "s.safetensors").stat().st_size, size, rel_tol=0.01)
