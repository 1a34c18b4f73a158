"""The streaming loader: round trip, rank/worker splitting, exact resume, epochs, corrupt shards, checks."""

from __future__ import annotations

import functools
import json
import shutil
from collections import Counter

import pytest
import torch
from support.data import assert_same_batches, loader_config, take

from data_pipeline import DataError
from data_pipeline.documents import read_documents
from data_pipeline.shard import Manifest, write_shards
from megatransformer.batch import IGNORE_INDEX
from megatransformer.training.data import build_run_loader as build_loader

make_cfg = functools.partial(loader_config, seed=1234)


def documents_of(stream: list[int], eos: int) -> tuple[list[list[int]], list[int]]:
    """Complete documents of a token stream that starts at a document start; and the unfinished tail."""
    docs, current = [], []
    for t in stream:
        if t == eos:
            docs.append(current)
            current = []
        else:
            current.append(t)
    return docs, current


def packed_stream(batches) -> list[int]:
    """The token stream a packed autoregressive loader read (windows overlap by one token: use the inputs)."""
    return [t for b in batches for row in b["input_ids"].tolist() for t in row]


def split_docs(tiny_data, tok, every=10):
    docs = [d.text for d in read_documents([str(tiny_data.corpus)])]
    valid = [d for i, d in enumerate(docs) if i % every == every - 1]
    train = [d for i, d in enumerate(docs) if i % every != every - 1]
    return train, valid


# ------------------------------------------------------------------------------------ round trip


def test_round_trip_valid_split_in_order(tiny_data, tok):
    """text -> shards -> loader -> detokenized text: the validation split comes back document by document."""
    loader = build_loader(make_cfg(tiny_data), "valid", 1, 0, 1, tok)
    batches = list(loader)
    docs, tail = documents_of(packed_stream(batches), tok.eos_id)
    _, expected = split_docs(tiny_data, tok)
    assert len(docs) >= len(expected) - 1
    assert [tok.decode(d) for d in docs] == expected[: len(docs)]
    assert expected[len(docs)].startswith(tok.decode(tail)) if tail else True
    # autoregressive labels: next token within a document, none across a boundary
    for b in batches:
        ids, labels, seg = b["input_ids"][0], b["labels"][0], b["segment_ids"][0]
        same = seg[1:] == seg[:-1]
        assert torch.equal(labels[:-1][same], ids[1:][same])
        assert (labels[:-1][~same] == IGNORE_INDEX).all()
    # positions restart at every document
    b = next(b for b in batches if b["segment_ids"].max() > 1)
    seg, pos = b["segment_ids"][0], b["position_ids"][0]
    starts = torch.nonzero(seg[1:] != seg[:-1]).flatten() + 1
    assert (pos[starts] == 0).all() and pos[0] == 0


@pytest.mark.parametrize("streams", [8, 64])
def test_streams_split_the_train_split(tiny_data, tok, streams):
    """One epoch of all streams serves every train document exactly once: whole shards per stream (8 streams,
    25 shards) or parts of shards (64 streams)."""
    from data_pipeline.loader.blocks import ShardOpener
    from data_pipeline.loader.reader import DocumentReader, Position
    from data_pipeline.loader.sources import resolve_datasets
    from data_pipeline.remote import Retry

    (shard_set,) = resolve_datasets(str(tiny_data.shards), "train", Retry())
    assert (len(shard_set.shards) < streams) == (streams == 64)
    opener = ShardOpener("error", Retry())
    served = Counter(
        tok.decode(tokens.tolist())
        for k in range(streams)
        for tokens, _, _ in DocumentReader(shard_set, 1234, k, streams, True, 4, opener, 1).documents(Position())
    )
    train, _ = split_docs(tiny_data, tok)
    assert served == Counter(train)


def test_ranks_get_disjoint_data_and_tp_peers_the_same(tiny_data, tok):
    cfg = make_cfg(tiny_data)
    a = take(build_loader(cfg, "train", 4, 0, 2, tok), 3)
    a_again = take(build_loader(cfg, "train", 4, 0, 2, tok), 3)  # e.g. a tensor-parallel peer of rank 0
    b = take(build_loader(cfg, "train", 4, 1, 2, tok), 3)
    assert_same_batches(a, a_again)
    rows_a = {tuple(r) for x in a for r in x["input_ids"].tolist()}
    rows_b = {tuple(r) for x in b for r in x["input_ids"].tolist()}
    assert not rows_a & rows_b


# ------------------------------------------------------------------------------------ exact resume


@pytest.mark.parametrize(
    "objective,arch,workers",
    [
        ("autoregressive", "decoder", 0),
        ("autoregressive", "decoder", 2),
        ("masked_lm", "encoder", 4),
        ("span_corruption", "encoder_decoder", 2),
        ("prefix_lm", "decoder", 0),
        ("prefix_lm", "encoder_decoder", 2),
    ],
)
def test_exact_resume(tiny_data, tok, objective, arch, workers):
    """The state after batch k (saved as JSON) reproduces batches k+1.. exactly, on every rank."""
    cfg = make_cfg(tiny_data, objective, arch, num_workers=workers)
    k, m = 5, 6
    for rank in range(2):
        reference = take(build_loader(cfg, "train", 3, rank, 2, tok), k + m)
        first = build_loader(cfg, "train", 3, rank, 2, tok)
        assert_same_batches(take(first, k), reference[:k])
        state = json.loads(json.dumps(first.state_dict()))
        assert len(json.dumps(state)) < 4000
        resumed = build_loader(cfg, "train", 3, rank, 2, tok)
        resumed.load_state_dict(state)
        assert_same_batches(take(resumed, m), reference[k:])


def test_resume_across_epochs_and_reshuffle(tmp_path, tiny_data, tok):
    """A small dataset rolls over several epochs; each epoch is reshuffled, and resume works mid-epoch."""
    docs = [f"Doc {i}: " + " ".join(["alpha beta"] * (i % 3 + 1)) for i in range(60)]
    (tmp_path / "small.txt").write_text("\n\n".join(docs))
    write_shards(
        [str(tmp_path / "small.txt")],
        str(tiny_data.tokenizer),
        tmp_path / "small",
        shard_mb=0.002,
        valid_every=0,
        workers=1,
        progress=False,
    )
    cfg = make_cfg(tiny_data, train=str(tmp_path / "small"), seq_len=32, num_workers=2, shuffle_buffer=32, streams=8)
    reference = take(build_loader(cfg, "train", 2, 0, 1, tok), 60)
    loader = build_loader(cfg, "train", 2, 0, 1, tok)
    take(loader, 37)
    assert max(p["epoch"] for s in loader.state_dict()["stream_states"].values() for p in s["positions"]) >= 1
    resumed = build_loader(cfg, "train", 2, 0, 1, tok)
    resumed.load_state_dict(loader.state_dict())
    assert_same_batches(take(resumed, 23), reference[37:])
    # epoch 0 and epoch 1 of one reader differ in order
    one = build_loader(
        make_cfg(tiny_data, train=str(tmp_path / "small"), seq_len=32, streams=1), "train", 1, 0, 1, tok, epochs=2
    )
    texts = [tok.decode(r) for b in one for r in b["input_ids"].tolist()]
    half = len(texts) // 2
    assert texts[:half] != texts[half : 2 * half]


def test_resume_refuses_what_cannot_continue(tiny_data, tok):
    loader = build_loader(make_cfg(tiny_data, num_workers=2), "train", 2, 0, 2, tok)
    take(loader, 2)
    wrong_rank = build_loader(make_cfg(tiny_data, num_workers=2), "train", 2, 1, 2, tok)
    with pytest.raises(DataError, match="rank 0 of 2, not to rank 1 of 2.*merge_states"):
        wrong_rank.load_state_dict(loader.state_dict())
    other_streams = build_loader(make_cfg(tiny_data, streams=32), "train", 2, 0, 2, tok)
    with pytest.raises(DataError, match="data.streams=64 to resume"):
        other_streams.load_state_dict(loader.state_dict())
    mixed = [{"path": str(tiny_data.shards), "weight": 1.0}, {"path": str(tiny_data.shards), "weight": 1.0}]
    other_data = build_loader(make_cfg(tiny_data, num_workers=2, train=mixed), "train", 2, 0, 2, tok)
    with pytest.raises(DataError, match="other shards"):
        other_data.load_state_dict(loader.state_dict())


def test_same_seed_same_batches_other_seed_other_batches(tiny_data, tok):
    cfg = make_cfg(tiny_data, "masked_lm", "encoder")
    a = take(build_loader(cfg, "train", 2, 0, 1, tok), 2)
    assert_same_batches(a, take(build_loader(cfg, "train", 2, 0, 1, tok), 2))
    other = cfg.model_copy(update={"seed": 99})
    b = take(build_loader(other, "train", 2, 0, 1, tok), 2)
    assert not torch.equal(a[0]["input_ids"], b[0]["input_ids"])


def test_validation_is_finite_and_identical_on_every_pass_and_rank(tiny_data, tok):
    cfg = make_cfg(tiny_data, "span_corruption", "encoder_decoder", num_workers=2)
    loader = build_loader(cfg, "valid", 4, 0, 2, tok)
    first, second = list(loader), list(loader)
    assert 0 < len(first) < 1000
    assert_same_batches(first, second)
    assert_same_batches(first, list(build_loader(cfg, "valid", 4, 1, 2, tok)))


# ------------------------------------------------------------------------------------ mixing


def test_mixing_by_weight(tmp_path, tiny_data, tok):
    docs = [" ".join(["QQ ZZ"] * (i % 5 + 3)) for i in range(400)]  # every 16-token window shows QQ or ZZ
    (tmp_path / "b.txt").write_text("\n\n".join(docs))
    write_shards(
        [str(tmp_path / "b.txt")],
        str(tiny_data.tokenizer),
        tmp_path / "b",
        shard_mb=0.01,
        valid_every=0,
        workers=1,
        progress=False,
    )
    train = [{"path": str(tiny_data.shards), "weight": 3.0}, {"path": str(tmp_path / "b"), "weight": 1.0}]
    loader = build_loader(make_cfg(tiny_data, train=train, seq_len=16), "train", 50, 0, 1, tok)
    rows = [tok.decode(r) for b in take(loader, 16) for r in b["input_ids"].tolist()]
    from_b = sum("QQ" in r or "ZZ" in r for r in rows) / len(rows)
    assert 0.25 - 0.05 < from_b < 0.25 + 0.05


# ------------------------------------------------------------------------------------ bad data


@pytest.fixture()
def shard_copy(tmp_path, tiny_data):
    copy = tmp_path / "shards"
    shutil.copytree(tiny_data.shards, copy)
    return copy


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_corrupt_shard_fails_with_its_name(shard_copy, tiny_data, tok, damage):
    victim = shard_copy / Manifest.load(shard_copy).splits["train"][3].file
    data = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(data[: len(data) // 2])
    else:
        victim.write_bytes(data[:700] + bytes([data[700] ^ 1]) + data[701:])
    loader = build_loader(make_cfg(tiny_data, train=str(shard_copy)), "train", 4, 0, 1, tok, epochs=1)
    with pytest.raises(DataError, match=f"corrupt shard .*{victim.name}.*on_corrupt=skip"):
        list(loader)


def test_corrupt_shard_skipped_counted_and_warned(shard_copy, tiny_data, tok):
    victim = shard_copy / Manifest.load(shard_copy).splits["train"][0].file
    victim.write_bytes(victim.read_bytes()[:1000])
    cfg = make_cfg(tiny_data, train=str(shard_copy), on_corrupt="skip")
    loader = build_loader(cfg, "train", 4, 0, 1, tok, epochs=1)
    with pytest.warns(UserWarning, match=f"corrupt shard .*{victim.name}"):
        batches = list(loader)
    assert loader.skipped_shards == [str(victim)]
    assert loader.metrics()["data/skipped_shards"] == 1.0
    assert len(batches) > 20
    # the skip is part of the state: a resumed run does not re-read (or re-warn about) the shard
    assert str(victim) in json.dumps(loader.state_dict())


def test_all_shards_corrupt_is_an_error_not_a_hang(shard_copy, tiny_data, tok):
    for shard in Manifest.load(shard_copy).splits["train"]:
        (shard_copy / shard.file).write_bytes(b"garbage")
    loader = build_loader(make_cfg(tiny_data, train=str(shard_copy), on_corrupt="skip"), "train", 4, 0, 1, tok)
    with pytest.warns(UserWarning), pytest.raises(DataError, match="no readable document"):
        take(loader, 1)


def test_checks_at_build_time(shard_copy, tmp_path, tiny_data, tok):
    with pytest.raises(DataError, match="model.vocab_size=256"):
        build_loader(
            make_cfg(tiny_data).model_copy(
                update={"model": make_cfg(tiny_data).model.model_copy(update={"vocab_size": 256})}
            ),
            "train",
            2,
            0,
            1,
            tok,
        )
    (tmp_path / "other.txt").write_text("another tokenizer entirely " * 50)
    from data_pipeline.tokenizer import train_tokenizer

    other = train_tokenizer([str(tmp_path / "other.txt")], 400, tmp_path / "other.json")
    with pytest.raises(DataError, match="another tokenizer"):
        build_loader(make_cfg(tiny_data), "train", 2, 0, 1, other)
    with pytest.raises(DataError, match="data.streams=64 cannot be dealt to 2 ranks x 20 workers.*num_workers=16"):
        build_loader(make_cfg(tiny_data, num_workers=20), "train", 2, 0, 2, tok)
    (shard_copy / Manifest.load(shard_copy).splits["train"][5].file).unlink()
    with pytest.raises(DataError, match="1 shard.* missing, e.g. .*train-000005.tar"):
        build_loader(make_cfg(tiny_data, train=str(shard_copy)), "train", 2, 0, 1, tok)
    with pytest.warns(UserWarning, match="train-000005.tar"):
        list(
            build_loader(
                make_cfg(tiny_data, train=str(shard_copy), on_corrupt="skip"), "train", 64, 0, 1, tok, epochs=1
            )
        )
    (shard_copy / "manifest.json").unlink()
    with pytest.raises(DataError, match="no manifest.json"):
        build_loader(make_cfg(tiny_data, train=str(shard_copy)), "train", 2, 0, 1, tok)
    (shard_copy / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid shard manifest"):
        build_loader(make_cfg(tiny_data, train=str(shard_copy)), "train", 2, 0, 1, tok)


# ------------------------------------------------------------------------------------ inspect


def test_inspect_cli_json(tmp_path, tiny_data, capsys):
    from megatransformer.cli import main

    config = tmp_path / "run.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"arch": "encoder", "vocab_size": 512, "d_model": 32, "n_heads": 2},
                "data": {"train": str(tiny_data.shards), "tokenizer": str(tiny_data.tokenizer), "seq_len": 64},
                "objective": "masked_lm",
                "train": {"micro_batch_size": 8},
            }
        )
    )
    assert main(["data", "inspect", "--config", str(config), "--batches", "6", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert abs(stats["selected_fraction"] - 0.15) < 0.03
    assert abs(stats["masked_fraction"] - 0.8) < 0.06
    assert stats["tokens_per_second"] > 0 and stats["padding_fraction"] == 0.0
    (dataset,) = stats["datasets"]
    assert dataset["directory"] == str(tiny_data.shards) and (dataset["format"], dataset["compression"]) == (2, None)
    assert main(["data", "inspect", "--config", str(config), "--batches", "1"]) == 0
    text = capsys.readouterr().out
    assert "->" in text and "selected_fraction" in text
    assert f"train data {tiny_data.shards}: format 2, uncompressed, {dataset['bytes_per_token']:.2f} bytes" in text
    assert (
        main(
            [
                "data",
                "inspect",
                "--config",
                str(config),
                "objective=span_corruption",
                "model.arch=encoder_decoder",
                "--json",
            ]
        )
        == 0
    )
    stats = json.loads(capsys.readouterr().out)
    assert 2.0 < stats["mean_noise_span_length"] < 4.5
    assert main(["data", "inspect", "--config", str(tmp_path / "missing.yaml")]) == 2
