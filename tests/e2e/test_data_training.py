"""The data order end to end: real `megatransformer train` runs reading shards over HTTP, and a one-shard
dataset on 2 ranks x 2 workers computing the losses of one rank."""

from __future__ import annotations

import pytest
from support.runs import losses, metrics, tiny_run, train
from support.shard_server import ShardServer

from data_pipeline.shard import Manifest, write_shards


def test_training_from_http_equals_training_from_the_directory(tiny_data, tmp_path):
    server = ShardServer(tiny_data.shards)
    try:
        remote, local = tmp_path / "remote", tmp_path / "local"
        train(tiny_run(tiny_data, remote, steps=4) + [f"data.train={server.url}", "data.num_workers=2"])
        train(tiny_run(tiny_data, local, steps=4) + ["data.num_workers=2"])
    finally:
        server.stop()
    assert any(r.endswith(".tar") for r in server.requests)
    assert len(losses(remote)) == 4 and losses(remote) == losses(local)
    val = [[r["val_loss"] for r in metrics(run) if "val_loss" in r] for run in (remote, local)]
    assert val[0] and val[0] == val[1]


def test_one_shard_on_two_ranks_of_two_workers_trains_like_one_rank(tiny_data, tmp_path):
    """A one-shard dataset trains on 2 ranks (streams, not shards, are dealt to ranks and workers), and with
    the global batch kept (2 ranks x micro 4 vs 1 rank x micro 4 x 2 accumulation) the steps see the same
    rows: the losses agree to fp32 reduction order."""
    write_shards(
        [str(tiny_data.corpus)],
        str(tiny_data.tokenizer),
        tmp_path / "one",
        shard_mb=64,
        valid_every=10,
        workers=1,
        progress=False,
    )
    assert len(Manifest.load(tmp_path / "one").splits["train"]) == 1
    two, one = tmp_path / "two", tmp_path / "one_rank"
    data = [f"data.train={tmp_path / 'one'}"]
    train(tiny_run(tiny_data, two, steps=4) + data + ["data.num_workers=2", "train.grad_accum=1"], nproc=2)
    train(tiny_run(tiny_data, one, steps=4) + data + ["train.grad_accum=2"])
    assert metrics(two)[0]["tokens"] == metrics(one)[0]["tokens"]
    assert losses(two) == pytest.approx(losses(one), rel=1e-5)
