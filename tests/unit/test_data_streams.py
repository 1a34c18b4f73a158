"""The data order of data.streams: the same global rows on any data-parallel size x worker count, loader states
that continue on another layout, and datasets with fewer shards than readers (tested on data_pipeline alone)."""

from __future__ import annotations

import functools

import pytest
from support import data
from support.data import assert_same_batches, loader_settings

from data_pipeline import DataError
from data_pipeline.loader import LoaderSettings, build_loader, check_data, merge_states
from data_pipeline.shard import Manifest, write_shards

GLOBAL_BATCH = 8


settings = functools.partial(loader_settings, seed=7, shuffle_buffer=64)


def global_rows(s: LoaderSettings, tok, dp: int, steps: int, micro: int, state: list[dict] | None = None):
    """The rows of ``steps`` global steps as the ranks of a ``dp``-rank run read them (each rank: micro batches
    of ``micro``, GLOBAL_BATCH / dp rows per step), put back in global order (rank r's local row i is global
    row r + dp * i); and each rank's loader afterwards."""
    per_rank = steps * GLOBAL_BATCH // dp
    assert per_rank % micro == 0
    loaders = []

    def each_rank():
        for rank in range(dp):
            loaders.append(build_loader(s, "train", micro, rank, dp, tok))
            if state is not None:
                loaders[-1].load_state_dict(state)
            yield loaders[-1]

    return data.global_rows(each_rank(), per_rank), loaders


@pytest.mark.parametrize("objective,arch", [("autoregressive", "decoder"), ("masked_lm", "encoder")])
def test_global_rows_do_not_depend_on_ranks_or_workers(tiny_data, tok, objective, arch):
    """With data.streams fixed, global steps 0..3 hold the same rows, in the same order, for dp 1, 2, 4 x
    workers 0, 2 (and other micro batch sizes)."""
    steps = 4  # 32 rows over 8 streams: every stream continues past its first sample
    reference, _ = global_rows(settings(tiny_data.shards, objective, arch, streams=8), tok, 1, steps, 4)
    assert len({tuple(r["input_ids"].tolist()) for r in reference}) == len(reference)  # no row repeated
    for dp in (1, 2, 4):
        for workers in (0, 2):
            micro = {1: 2, 2: 4, 4: 1}[dp]
            rows, _ = global_rows(
                settings(tiny_data.shards, objective, arch, streams=8, num_workers=workers), tok, dp, steps, micro
            )
            assert_same_batches(rows, reference)


@pytest.mark.parametrize("before,after", [((2, 2), (1, 0)), ((1, 0), (4, 2)), ((4, 0), (2, 2)), ((2, 0), (2, 2))])
def test_state_continues_on_another_layout(tiny_data, tok, before, after):
    """Loader states saved after 3 steps on (dp, workers) = before, merged, continue the same global rows on
    after: rows of steps 3..5 equal those of an uninterrupted run."""
    reference, _ = global_rows(settings(tiny_data.shards, streams=16), tok, 1, 6, 8)
    (dp, workers), (new_dp, new_workers) = before, after
    first, loaders = global_rows(settings(tiny_data.shards, streams=16, num_workers=workers), tok, dp, 3, 2)
    assert_same_batches(first, reference[:24])
    saved = merge_states([loader.state_dict() for loader in loaders])
    assert saved["rows"] == 24
    rest, _ = global_rows(
        settings(tiny_data.shards, streams=16, num_workers=new_workers), tok, new_dp, 3, 2, state=saved
    )
    assert_same_batches(rest, reference[24:])
    if dp == new_dp:  # the same ranks with other workers continue from their own states as well
        for rank, loader in enumerate(loaders):
            again = build_loader(
                settings(tiny_data.shards, streams=16, num_workers=new_workers), "train", 2, rank, dp, tok
            )
            again.load_state_dict(loader.state_dict())
            batch = next(iter(again))
            assert_same_batches(
                [{k: v[j] for k, v in batch.items()} for j in range(2)],
                [reference[24 + rank + dp * j] for j in range(2)],
            )
    # the ranks' own states are accepted as a list (merged on loading) too
    rest_from_list, _ = global_rows(
        settings(tiny_data.shards, streams=16), tok, 1, 1, 8, state=[loader.state_dict() for loader in loaders]
    )
    assert_same_batches(rest_from_list, reference[24:32])


def test_states_that_cannot_be_merged_or_split(tiny_data, tok):
    s = settings(tiny_data.shards, streams=16)
    _, loaders = global_rows(s, tok, 2, 1, 4)
    with pytest.raises(DataError, match="ranks 0..1, got ranks \\[0\\]"):
        merge_states([loaders[0].state_dict()])
    lagging_state = {**loaders[1].state_dict(), "rows": 8}  # a rank one step ahead
    with pytest.raises(DataError, match="do not belong together"):
        merge_states([loaders[0].state_dict(), lagging_state])
    odd = merge_states([loaders[0].state_dict(), loaders[1].state_dict()]) | {"rows": 6}
    with pytest.raises(DataError, match="global row 6, which 4 data-parallel ranks cannot split"):
        build_loader(s, "train", 1, 0, 4, tok).load_state_dict(odd)
    with pytest.raises(DataError, match="inconsistent: stream 7 made 1 samples, 0 expected after 7 rows"):
        build_loader(s, "train", 1, 0, 1, tok).load_state_dict(odd | {"rows": 7})


def test_one_shard_feeds_two_ranks_of_two_workers(tmp_path, tiny_data, tok):
    """A one-shard dataset (fewer shards than readers) trains on 2 ranks x 2 workers, with
    the rows of one rank without workers."""
    write_shards(
        [str(tiny_data.corpus)],
        str(tiny_data.tokenizer),
        tmp_path / "one",
        shard_mb=64,
        valid_every=0,
        workers=1,
        progress=False,
    )
    assert len(Manifest.load(tmp_path / "one").splits["train"]) == 1
    s = settings(tmp_path / "one")  # the default 64 streams: parts of the one shard
    reference, _ = global_rows(s, tok, 1, 3, 4)
    rows, _ = global_rows(settings(tmp_path / "one", num_workers=2), tok, 2, 3, 2)
    assert_same_batches(rows, reference)
    assert len({tuple(r["input_ids"].tolist()) for r in rows}) == len(rows)


def test_layouts_that_do_not_divide_the_streams_fail_early(tmp_path, tiny_data, tok):
    with pytest.raises(DataError, match="data.streams=64 cannot be dealt to 3 ranks x 1 workers.*data-parallel size"):
        build_loader(settings(tiny_data.shards), "train", 2, 0, 3, tok)
    (tmp_path / "tiny.txt").write_text("\n\n".join(f"document number {i}" for i in range(10)))
    write_shards(
        [str(tmp_path / "tiny.txt")],
        str(tiny_data.tokenizer),
        tmp_path / "tiny",
        valid_every=0,
        workers=1,
        progress=False,
    )
    with pytest.raises(
        DataError, match="1 train shard\\(s\\) with as few as 10 documents cannot feed data.streams=64.*to 10 or less"
    ):
        build_loader(settings(tmp_path / "tiny"), "train", 2, 0, 1, tok)
    assert next(iter(build_loader(settings(tmp_path / "tiny", streams=8), "train", 2, 0, 1, tok)))
    # the same checks from the manifests alone, before a run's engines start (and DeepSpeed builds its ops)
    with pytest.raises(DataError, match="cannot feed data.streams=64"):
        check_data(settings(tmp_path / "tiny"), tok, dp_size=2)
    with pytest.raises(DataError, match="data.streams=8 cannot be dealt to 3 ranks"):
        check_data(settings(tmp_path / "tiny", streams=8), tok, dp_size=3)
    check_data(settings(tmp_path / "tiny", streams=8, valid=str(tiny_data.shards)), tok, dp_size=2)
