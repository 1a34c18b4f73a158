"""The sharded checkpoint format without DeepSpeed: files hashed as they are written, pieces of parameters
assembled one tensor at a time or read slice by slice, on the layout that wrote them or another one."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from support.checkpoints import write_checkpoint

from megatransformer import checkpoint as ckpt
from megatransformer.checkpoint import sharded
from megatransformer.checkpoint.sharded import ParamLayout, Piece, ShardedState


def test_a_shard_is_a_safetensors_file_hashed_as_written(tmp_path):
    tensors = {"fp32/w/0/0": torch.randn(7), "exp_avg/w/0/0": torch.randn(7), "empty": torch.zeros(0)}
    entry = sharded.write_safetensors(tmp_path / "s.safetensors", tensors, {"save": "abc", "step": "3"})
    assert entry == ckpt.file_entry(tmp_path / "s.safetensors")  # the hash of the bytes on disk, never read back
    loaded = load_file(tmp_path / "s.safetensors")
    assert loaded.keys() == tensors.keys() and all(torch.equal(loaded[k], v) for k, v in tensors.items())
    assert sharded.write_file(tmp_path / "t", b"hello") == ckpt.file_entry(tmp_path / "t")


def test_a_failed_write_leaves_no_file(tmp_path):
    with pytest.raises(KeyError):  # (a dtype the format does not store)
        sharded.write_safetensors(tmp_path / "s.safetensors", {"x": torch.zeros(2, dtype=torch.int64)}, {})
    assert not (tmp_path / "s.safetensors").exists()


FULL = {"w": torch.arange(72.0).reshape(12, 6), "b": torch.arange(6.0), "v": torch.arange(36.0).reshape(6, 6)}
DIMS = {"w": 0, "b": None, "v": 1}


@pytest.mark.parametrize("tp,dp", [(1, 1), (1, 3), (2, 2), (3, 1)])
def test_a_parameter_is_assembled_whole_from_its_pieces(tmp_path, tp, dp):
    full = FULL
    write_checkpoint(tmp_path, full, tp, dp, DIMS)
    state = ShardedState(tmp_path)
    for name, tensor in full.items():
        assert torch.equal(state.tensor(name), tensor) and torch.equal(state.tensor(name, "exp_avg"), 2 * tensor)
    assert torch.equal(dict(state.weights())["tied.weight"], full["w"])
    assert state.names() == ["w", "b", "v", "tied.weight"]


@pytest.mark.parametrize("saved,now", [((2, 2), (2, 3)), ((2, 2), (1, 1)), ((1, 3), (2, 2)), ((1, 1), (3, 2))])
def test_a_rank_reads_its_slice_on_any_layout(tmp_path, saved, now):
    full = FULL
    write_checkpoint(tmp_path, full, *saved, DIMS)
    state = ShardedState(tmp_path)
    tp, dp = now
    for name, tensor in full.items():
        dim = DIMS[name]
        for t in range(tp if dim is not None else 1):
            flat = (tensor.chunk(tp, dim)[t] if dim is not None else tensor).reshape(-1)
            for d in range(dp):
                lo, hi = flat.numel() * d // dp, flat.numel() * (d + 1) // dp
                got = state.slice_of(name, "exp_avg", t, tp, dim, lo, hi)
                assert torch.equal(got, 2 * flat[lo:hi]), (name, t, d)


def test_on_the_saved_layout_only_the_overlapping_pieces_are_read(tmp_path, monkeypatch):
    write_checkpoint(tmp_path, {"b": torch.arange(12.0)}, 1, 4, {"b": None})
    state = ShardedState(tmp_path)
    opened = []
    shard = state._shard
    monkeypatch.setattr(state, "_shard", lambda file: opened.append(file) or shard(file))
    assert torch.equal(state.slice_of("b", "fp32", 0, 1, None, 4, 7), torch.arange(4.0, 7.0))
    assert sorted(set(opened)) == ["shard_00001.safetensors", "shard_00002.safetensors"]


def test_a_shard_of_another_save_is_refused(tmp_path):
    write_checkpoint(tmp_path / "a", FULL, 1, 2, DIMS, save="first")
    write_checkpoint(tmp_path / "b", FULL, 1, 2, DIMS, save="second")
    (tmp_path / "b" / "shard_00001.safetensors").write_bytes((tmp_path / "a" / "shard_00001.safetensors").read_bytes())
    state = ShardedState(tmp_path / "b")
    with pytest.raises(ckpt.CheckpointDamaged, match="shard_00001.safetensors: a shard of another save"):
        state.tensor("w")


def test_a_missing_shard_or_index_is_named(tmp_path):
    write_checkpoint(tmp_path, FULL, 1, 2, DIMS)
    (tmp_path / "shard_00001.safetensors").unlink()
    with pytest.raises(ckpt.CheckpointDamaged, match="shard_00001.safetensors: missing"):
        ShardedState(tmp_path).tensor("w")
    (tmp_path / sharded.INDEX).unlink()
    with pytest.raises(ckpt.CheckpointDamaged, match="index.json: missing"):
        ShardedState(tmp_path)


def test_pieces_that_leave_a_gap_or_overlap_are_a_bug_found_at_the_save():
    with pytest.raises(ValueError, match="gap or an overlap at element 3"):
        sharded.check_cover("b", ParamLayout((6,), None, 1, (Piece(0, 0, 3, "a"), Piece(0, 4, 6, "b"))))
    with pytest.raises(ValueError, match=r"pieces of slice 0 cover 5 elements, its shape \[6\] 6"):
        sharded.check_cover("b", ParamLayout((6,), None, 1, (Piece(0, 0, 5, "a"),)))


@pytest.mark.parametrize(
    "edit,why",
    [
        (lambda p: p["w"].update(shape=[14, 6]), r"w: the pieces of slice 0 cover 36 elements, its shape \[7, 6\] 42"),
        (lambda p: p["b"].update(shape=[7]), r"b: the pieces of slice 0 cover 6 elements, its shape \[7\] 7"),
        (lambda p: p["v"].update(shape=[6, 7]), r"v: dimension 1 of shape \[6, 7\] split 2 ways"),
        (lambda p: p["v"].update(tp_dim=2), r"v: split along dimension 2 of shape \[6, 6\]"),
        (lambda p: p["b"]["pieces"][0].__setitem__(1, -3), r"b: a piece of elements \[-3, "),
        (lambda p: p["w"]["pieces"][0].__setitem__(0, 5), r"w: a piece of slice 5 of 2"),
    ],
)
def test_an_index_whose_pieces_do_not_cover_its_shapes_is_refused_by_every_reader(tmp_path, edit, why):
    """An index.json edited to grow a parameter (its manifest made to match): no reader returns an element that
    was never read (export wrote the extra row from uninitialized memory)."""
    import json

    write_checkpoint(tmp_path, FULL, 2, 2, DIMS)
    record = json.loads((tmp_path / sharded.INDEX).read_text())
    edit(record["params"])
    (tmp_path / sharded.INDEX).write_text(json.dumps(record))
    with pytest.raises(ckpt.CheckpointDamaged, match=f"index.json: {why}") as err:
        ShardedState(tmp_path)
    assert "\n" not in str(err.value)


def test_a_slice_beyond_the_saved_elements_is_refused(tmp_path):
    write_checkpoint(tmp_path, {"b": torch.arange(12.0)}, 1, 2, {"b": None})
    with pytest.raises(ckpt.CheckpointDamaged, match="b: its pieces hold 2 of the 4 elements asked for"):
        ShardedState(tmp_path).slice_of("b", "fp32", 0, 1, None, 10, 14)


def test_bytes_on_disk_are_the_state_and_a_small_header(tmp_path):
    write_checkpoint(tmp_path, FULL, 2, 2, DIMS)
    params = sum(math.prod(t.shape) for t in FULL.values())
    shards = sum(p.stat().st_size for p in tmp_path.glob("shard_*"))
    header = shards - 2 * 4 * params  # two kinds of fp32 state here
    assert 0 < header < 4096


@pytest.mark.parametrize("now", [(2, 2), (1, 3)])
def test_a_rank_hashes_exactly_the_shards_it_reads(tmp_path, monkeypatch, now):
    """What a rank verifies at a resume (``files_of`` its slices, then ``verify_files``) is what it then opens to
    read them: on the saved layout its own pieces' files only, on another the files of the parameters it cuts
    its slices from; every file hashed once."""
    write_checkpoint(tmp_path, FULL, 2, 2, DIMS)
    ckpt.write_manifest(tmp_path)
    hashed: list[str] = []
    file_entry = ckpt.integrity.file_entry
    monkeypatch.setattr(ckpt.integrity, "file_entry", lambda path: hashed.append(path.name) or file_entry(path))
    tp, dp = now
    everyone = set()
    for t in range(tp):
        for d in range(dp):
            state = ShardedState(tmp_path)
            opened: list[str] = []
            shard = state._shard
            monkeypatch.setattr(
                state, "_shard", lambda file, shard=shard, opened=opened: opened.append(file) or shard(file)
            )
            slices = []
            for name, tensor in FULL.items():
                dim = DIMS[name]
                numel = tensor.numel() // (tp if dim is not None else 1)
                slices.append((name, t if dim is not None else 0, tp, dim, numel * d // dp, numel * (d + 1) // dp))
            reads = set().union(*(state.files_of(*where) for where in slices))
            hashed.clear()
            ckpt.verify_files(tmp_path, reads)
            for name, *where in slices:
                state.slice_of(name, "fp32", *where)
            assert sorted(hashed) == sorted(set(opened)) == sorted(reads), (t, d)
            everyone |= reads
            if now == (2, 2):
                ranks = {t * 2 + d, d}  # (its own pieces; "b", not split, is in the first slice's shards)
                assert reads == {sharded.shard_file(r) for r in ranks}, (t, d)
    assert everyone == {p.name for p in tmp_path.glob("shard_*")}


def test_a_damaged_shard_is_found_only_by_the_ranks_that_read_it(tmp_path):
    write_checkpoint(tmp_path, FULL, 1, 2, DIMS)
    ckpt.write_manifest(tmp_path)
    data = bytearray((tmp_path / "shard_00001.safetensors").read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])
    (tmp_path / "shard_00001.safetensors").write_bytes(bytes(data))
    ckpt.verify_files(tmp_path, ["shard_00000.safetensors", sharded.INDEX])
    ckpt.verify_checkpoint(tmp_path, rank_parts=False)  # (what rank 0 checks, picking the checkpoint)
    with pytest.raises(ckpt.CheckpointDamaged, match="shard_00001.safetensors: changed since the save"):
        ckpt.verify_files(tmp_path, ["shard_00001.safetensors"])
    with pytest.raises(ckpt.CheckpointDamaged, match="shard_00001.safetensors: changed since the save"):
        ckpt.verify_checkpoint(tmp_path)


@pytest.mark.parametrize("saved", [(1, 1), (2, 3)])
def test_lazy_weights_read_a_flat_range_of_a_tensor_as_a_zero_3_partition_needs_it(tmp_path, saved):
    from megatransformer.checkpoint.files import LazyWeights

    write_checkpoint(tmp_path, FULL, *saved, DIMS)
    lazy = LazyWeights(tmp_path)
    for name, tensor in {**FULL, "tied.weight": FULL["w"]}.items():
        dim = DIMS.get(name, 0)
        for parts in (1, 2, 3) if dim is not None else (1,):
            for index, part in enumerate(tensor.chunk(parts, dim or 0)):  # (a tensor-parallel slice, partitioned)
                flat = part.reshape(-1)
                for lo, hi in [(0, flat.numel()), (1, 5), (5, min(17, flat.numel())), (flat.numel() - 1, flat.numel())]:
                    got = lazy.flat(name, lo, hi, dim, index, parts)
                    assert torch.equal(got, flat[lo:hi]), (name, parts, index, lo, hi)
