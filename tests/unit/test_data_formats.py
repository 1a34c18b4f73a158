"""Shard format 2 (blocks of documents, plain or zstd-compressed) against format 1 (a sample per document): the
same documents in the same shards give the same global rows, resumed exactly or elastically, with skipped rows,
in mixtures and over HTTP."""

from __future__ import annotations

import functools

import pytest
from support import data
from support.data import assert_same_batches, loader_settings, reformat_shards
from support.shard_server import ShardServer

from data_pipeline.loader import LoaderSettings, build_loader, merge_states
from data_pipeline.loader import reader as loader_reader
from data_pipeline.settings import Dataset, DataSettings
from data_pipeline.shard import Manifest

settings = functools.partial(loader_settings, seed=11, shuffle_buffer=64, streams=8)


@pytest.fixture(scope="module")
def formats(tiny_data, tiny_instructions, tmp_path_factory):
    """tiny_data's and tiny_instructions' shards in format 1, in format 2 (blocks of other sizes than the
    session fixtures') and in format 2 compressed, each holding the same documents in the same shards."""
    root = tmp_path_factory.mktemp("formats")
    made = {}
    for name, src in (("text", tiny_data.shards), ("instructions", tiny_instructions.shards)):
        made[name, 1] = reformat_shards(src, root / f"{name}-1", 1)
        made[name, 2] = reformat_shards(src, root / f"{name}-2", 2, block_bytes=1500)
        made[name, "zstd"] = reformat_shards(src, root / f"{name}-zstd", 2, block_bytes=1500, compression="zstd")
    return made


def rows(s, tok, dp: int, micro: int, per_rank: int, state=None, skip=None):
    """Global rows of ``dp`` ranks' loaders (each ``per_rank`` rows), with a state loaded and rows skipped."""

    def ranks():
        for rank in range(dp):
            reader = build_loader(s, "train", micro, rank, dp, tok)
            if state is not None:
                reader.load_state_dict(state)
            if skip is not None:
                reader.skip_rows(*skip)
            yield reader

    return data.global_rows(ranks(), per_rank)


def test_the_pairs_hold_the_same_documents_in_the_same_shards(formats):
    for name in ("text", "instructions"):
        one, two = (Manifest.load(formats[name, v]) for v in (1, 2))
        assert (one.version, two.version) == (1, 2)
        for split in one.splits:
            assert [s.documents for s in one.splits[split]] == [s.documents for s in two.splits[split]]
            assert [s.tokens for s in one.splits[split]] == [s.tokens for s in two.splits[split]]
            assert all(s.samples == s.documents for s in one.splits[split])
            assert all(s.samples < s.documents for s in two.splits[split])


@pytest.mark.parametrize(
    "name,objective,arch",
    [
        ("text", "autoregressive", "decoder"),
        ("text", "masked_lm", "encoder"),
        ("text", "span_corruption", "encoder_decoder"),
        ("instructions", "autoregressive", "decoder"),
        ("instructions", "prefix_lm", "encoder_decoder"),
    ],
)
@pytest.mark.parametrize("shuffle_buffer", [64, 3])  # documents shuffled together: many blocks' worth, part of one
def test_both_formats_give_the_same_global_rows(formats, tok, name, objective, arch, shuffle_buffer, monkeypatch):
    one, two = (settings(formats[name, v], objective, arch, shuffle_buffer=shuffle_buffer) for v in (1, 2))
    expected = rows(one, tok, 2, 4, 16)
    assert_same_batches(rows(two, tok, 2, 4, 16), expected)
    monkeypatch.setattr(loader_reader, "RUN_TOKENS", 40)  # runs of one or a few shuffle blocks, cut inside tar samples
    assert_same_batches(rows(two, tok, 2, 4, 16), expected)


def test_resume_exact_and_elastic_on_format_2_continues_format_1s_rows(formats, tok):
    """Format 2 read for 12 rows on 2 ranks with 2 workers, saved, then continued on the same ranks (exact)
    and on 1 rank (elastic, the states merged): the rows an uninterrupted format-1 run reads."""
    reference = rows(settings(formats["text", 1]), tok, 1, 4, 48)
    two = settings(formats["text", 2], num_workers=2)
    loaders = [build_loader(two, "train", 2, rank, 2, tok) for rank in range(2)]
    first = data.global_rows(loaders, 6)
    assert_same_batches(first, reference[:12])
    states = [reader.state_dict() for reader in loaders]
    resumed = []
    for rank, state in enumerate(states):
        reader = build_loader(two, "train", 2, rank, 2, tok)
        reader.load_state_dict(state)
        resumed.append(reader)
    assert_same_batches(data.global_rows(resumed, 6), reference[12:24])
    elastic = rows(settings(formats["text", 2]), tok, 1, 4, 24, state=merge_states(states))
    assert_same_batches(elastic, reference[12:36])


def test_skipped_rows_are_the_same_on_both_formats(formats, tok):
    one, two = (settings(formats["text", v]) for v in (1, 2))
    skipped = rows(two, tok, 2, 2, 12, skip=(8, 20))
    assert_same_batches(skipped, rows(one, tok, 2, 2, 12, skip=(8, 20)))
    assert_same_batches(skipped, rows(one, tok, 2, 2, 18)[:8] + rows(one, tok, 2, 2, 18)[20:36])


def test_mixtures_of_either_format_give_the_same_rows(formats, tok):
    def mixture(a: int, b: int) -> LoaderSettings:
        train = [Dataset(str(formats["text", a]), 3.0), Dataset(str(formats["text", b]), 1.0)]
        data_settings = DataSettings(train=train, seq_len=32, streams=8, shuffle_buffer=64)
        return LoaderSettings(data_settings, "autoregressive", "decoder", vocab_size=512, seed=11)

    reference = rows(mixture(1, 1), tok, 2, 4, 16)
    assert_same_batches(rows(mixture(2, 2), tok, 2, 4, 16), reference)
    assert_same_batches(rows(mixture(2, 1), tok, 2, 4, 16), reference)  # the formats may be mixed
    assert_same_batches(rows(mixture("zstd", 1), tok, 2, 4, 16), reference)  # and compressed with plain


def test_compressed_shards_are_smaller_and_give_the_same_rows_locally_and_over_http(formats, tok):
    for name, objective, arch in (("text", "autoregressive", "decoder"), ("instructions", "prefix_lm", "decoder")):
        plain, packed = (Manifest.load(formats[name, v]) for v in (2, "zstd"))
        assert (plain.compression, packed.compression) == (None, "zstd")
        assert packed.bytes_per_token("train") < 0.8 * plain.bytes_per_token("train")
        expected = rows(settings(formats[name, 2], objective, arch), tok, 2, 4, 16)
        assert_same_batches(rows(settings(formats[name, "zstd"], objective, arch), tok, 2, 4, 16), expected)
    server = ShardServer(formats["text", "zstd"])
    try:
        remote = rows(settings(server.url, num_workers=2), tok, 1, 4, 24)
    finally:
        server.stop()
    assert_same_batches(remote, rows(settings(formats["text", 2]), tok, 1, 4, 24))


def test_resume_on_compressed_shards_continues_the_rows(formats, tok):
    reference = rows(settings(formats["text", "zstd"]), tok, 1, 4, 24)
    assert_same_batches(reference, rows(settings(formats["text", 2]), tok, 1, 4, 24))
    packed = settings(formats["text", "zstd"], num_workers=2)
    first = build_loader(packed, "train", 4, 0, 1, tok)
    assert_same_batches(data.global_rows([first], 12), reference[:12])
    resumed = build_loader(packed, "train", 4, 0, 1, tok)
    resumed.load_state_dict(first.state_dict())
    assert_same_batches(data.global_rows([resumed], 12), reference[12:])


def test_a_stream_reading_part_of_a_compressed_shard_decompresses_its_part_only(tiny_data, tmp_path, monkeypatch):
    """A one-shard dataset read by 8 streams (each a part of the shard): together they read every document once,
    in order, and each decompresses the blocks of its own part only (those before it are only counted)."""
    from data_pipeline.loader.blocks import ShardOpener
    from data_pipeline.loader.reader import DocumentReader, Position
    from data_pipeline.loader.sources import resolve_datasets
    from data_pipeline.remote import Retry
    from data_pipeline.shard import Block, write_shards

    out = tmp_path / "one-shard"
    kw = {"shard_mb": 64, "block_mb": 0.004, "valid_every": 0, "workers": 1, "progress": False}
    write_shards([str(tiny_data.corpus)], str(tiny_data.tokenizer), out, compression="zstd", **kw)
    (info,) = Manifest.load(out).splits["train"]
    read_blocks = []
    from_sample = Block.from_sample
    monkeypatch.setattr(Block, "from_sample", staticmethod(lambda *a: read_blocks.append(1) or from_sample(*a)))
    (shard_set,) = resolve_datasets(str(out), "train", Retry())
    streams = [
        [ids.tolist() for ids, _, _ in DocumentReader(shard_set, 0, k, 8, False, 1, opener, 1).documents(Position())]
        for k, opener in ((k, ShardOpener("error", Retry())) for k in range(8))
    ]
    assert [doc for stream in streams for doc in stream] == [ids for ids, _ in data.shard_documents(out)]
    assert info.samples > 40 and len(read_blocks) <= 2 * info.samples + 8  # (from the start each: 5x)
