"""A checkpoint every rank of a job loads (init_from, eval at ZeRO-3) is verified once across the job: each file of
its weights hashed by one rank, dealt by bytes, the verdicts agreed before any rank loads, so that damage one rank
finds stops every rank with the same line. The ranks here are threads meeting at a barrier."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from support.checkpoints import write_checkpoint
from support.thread_ranks import ThreadRanks, thread_group

from megatransformer import checkpoint as ckpt
from megatransformer.checkpoint import sharded
from megatransformer.config import dump_config, validate

WORLD = 3
FULL = {"w": torch.arange(96.0).reshape(16, 6), "b": torch.arange(6.0), "v": torch.arange(36.0).reshape(6, 6)}
DIMS = {"w": 0, "b": None, "v": 1}


@pytest.fixture
def ranks(monkeypatch) -> ThreadRanks:
    return thread_group(monkeypatch, WORLD)


@pytest.fixture
def hashed(ranks, monkeypatch) -> list[tuple[int, str]]:
    """(rank, file) for every file the ranks hash."""
    seen: list[tuple[int, str]] = []
    file_entry = ckpt.integrity.file_entry
    monkeypatch.setattr(
        ckpt.integrity, "file_entry", lambda path: seen.append((ranks.rank(), path.name)) or file_entry(path)
    )
    return seen


def training_checkpoint(path, dp: int = 4):
    """A training checkpoint of ``dp`` shards (weights and a moment), with its config and manifest."""
    write_checkpoint(path, FULL, 1, dp, DIMS)
    (path / ckpt.CONFIG).write_text(dump_config(validate({})))
    ckpt.write_manifest(path)
    return path


def test_files_are_dealt_by_bytes_each_to_one_rank():
    sizes = {"a": 100, "b": 70, "c": 50, "d": 30, "e": 30, "f": 0}
    dealt = ckpt.deal_by_size(sizes, 3)
    assert sorted(name for share in dealt for name in share) == sorted(sizes)
    loads = [sum(sizes[name] for name in share) for share in dealt]
    assert loads == [100, 100, 80] and dealt == ckpt.deal_by_size(dict(reversed(sizes.items())), 3)
    assert ckpt.deal_by_size({"a": 5}, 4) == [["a"], [], [], []]


def test_each_shard_is_hashed_by_one_rank(tmp_path, ranks, hashed):
    path = training_checkpoint(tmp_path)
    hashed.clear()
    outcomes = ranks.run(lambda: ckpt.load_weights(path, lazy=True, shared=True)[1]["w"])
    assert all(err is None and torch.equal(w, FULL["w"]) for w, err in outcomes), outcomes
    shards = Counter(name for _, name in hashed if name.startswith("shard_"))
    assert shards == {sharded.shard_file(r): 1 for r in range(4)}
    assert {rank for rank, name in hashed if name.startswith("shard_")} == set(range(WORLD))
    for rank in range(WORLD):  # (the small files every rank reads, each rank checks itself)
        assert sorted(name for r, name in hashed if r == rank and not name.startswith("shard_")) == [
            ckpt.CONFIG,
            sharded.INDEX,
        ]


def test_damage_one_rank_finds_stops_every_rank_with_its_line(tmp_path, ranks, hashed):
    path = training_checkpoint(tmp_path)
    damaged = sharded.shard_file(2)
    data = bytearray((path / damaged).read_bytes())
    data[-4:] = bytes(b ^ 0xFF for b in data[-4:])
    (path / damaged).write_bytes(bytes(data))
    hashed.clear()
    outcomes = ranks.run(lambda: ckpt.load_weights(path, lazy=True, shared=True))
    errors = [err for _, err in outcomes]
    assert all(isinstance(err, ckpt.CheckpointDamaged) for err in errors), errors
    assert len({str(err) for err in errors}) == 1
    assert (
        str(errors[0])
        == f"checkpoint {path}: {damaged}: changed since the save (its sha256 differs from the manifest's)"
    )
    assert [name for _, name in hashed].count(damaged) == 1


def test_one_process_hashes_every_file_it_reads(tmp_path, monkeypatch):
    path = training_checkpoint(tmp_path)
    seen: list[str] = []
    file_entry = ckpt.integrity.file_entry
    monkeypatch.setattr(ckpt.integrity, "file_entry", lambda p: seen.append(p.name) or file_entry(p))
    ckpt.load_weights(path, lazy=True, shared=True)  # (no process group: this process is the job)
    assert sorted(seen) == sorted([ckpt.CONFIG, sharded.INDEX, *(sharded.shard_file(r) for r in range(4))])


def test_each_file_of_a_weights_checkpoint_is_hashed_by_one_rank(tmp_path, ranks, hashed):
    path = ckpt.write_weights_checkpoint(tmp_path / "weights", validate({}), FULL, shard_bytes=200)
    files = ckpt.indexed_files(path)
    assert len(files) == 2
    hashed.clear()
    outcomes = ranks.run(lambda: dict(ckpt.load_weights(path, lazy=True, shared=True)[1]))
    assert all(err is None and torch.equal(got["v"], FULL["v"]) for got, err in outcomes), outcomes
    assert Counter(name for _, name in hashed if name in files) == dict.fromkeys(files, 1)
