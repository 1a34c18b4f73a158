"""Shard format 2 (blocks of documents) against format 1 (a sample per document): the same documents in the
same shards give the same global rows, resumed exactly or elastically, with skipped rows and in mixtures."""

from __future__ import annotations

import functools

import pytest
from support import data
from support.data import assert_same_batches, loader_settings, reformat_shards

from data_pipeline import loader
from data_pipeline.loader import LoaderSettings, build_loader, merge_states
from data_pipeline.settings import Dataset, DataSettings
from data_pipeline.shard import Manifest

settings = functools.partial(loader_settings, seed=11, shuffle_buffer=64, streams=8)


@pytest.fixture(scope="module")
def formats(tiny_data, tiny_instructions, tmp_path_factory):
    """tiny_data's and tiny_instructions' shards in format 1 and in format 2 (blocks of other sizes than the
    session fixtures'), each pair holding the same documents in the same shards."""
    root = tmp_path_factory.mktemp("formats")
    made = {}
    for name, src in (("text", tiny_data.shards), ("instructions", tiny_instructions.shards)):
        made[name, 1] = reformat_shards(src, root / f"{name}-1", 1)
        made[name, 2] = reformat_shards(src, root / f"{name}-2", 2, block_bytes=1500)
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
    monkeypatch.setattr(loader, "RUN_TOKENS", 40)  # runs of one or a few shuffle blocks, cut inside tar samples
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
