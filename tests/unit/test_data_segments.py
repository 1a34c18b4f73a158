"""The same input gives the same shards, and so the same training rows, whether it is tokenized in one run or
as N parts (`data shard --part K/N`) joined by `data merge`: shards are cut at the input's segments, which
depend on the files alone; parts are whole segments, balanced by the input's text."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard
from support.data import assert_same_batches, loader_settings, take

from data_pipeline import DataError
from data_pipeline.documents import input_files, read_documents
from data_pipeline.loader import build_loader
from data_pipeline.merge import merge_parts
from data_pipeline.parts import PART_RECORD, part_name, part_segments, segments
from data_pipeline.shard import SEGMENT_SHARDS, Manifest, write_shards

SHARD_MB = 0.004  # segments of SEGMENT_SHARDS x 4 KiB of text: a dozen or more in the corpus below


@pytest.fixture(scope="module")
def corpus(tiny_data, tmp_path_factory):
    """The demo corpus's documents over files of every kind and size: plain, .gz and .zst (a frame without its
    size) text, parquet files of many row groups."""
    root = tmp_path_factory.mktemp("mixed")
    docs = [d.text for d in read_documents([str(tiny_data.corpus)])]
    chunks = [docs[i::6] for i in range(6)]
    (root / "a.txt").write_text("\n\n".join(chunks[0]))
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in chunks[1])
    pq.write_table(pa.table({"text": chunks[2]}), root / "c.parquet", row_group_size=10)
    with open(root / "d.jsonl.zst", "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as z:
        z.write("".join(json.dumps({"text": t}) + "\n" for t in chunks[3]).encode())
    (root / "e.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chunks[4]))
    for i in range(4):  # small files, several to a segment
        (root / f"f{i}.txt").write_text("\n\n".join(chunks[5][i::4]))
    pq.write_table(pa.table({"text": docs[:200]}), root / "g.parquet", row_group_size=7)
    return input_files([str(root)])


def shard(corpus, tiny_data, out, **kw):
    return write_shards(
        corpus, str(tiny_data.tokenizer), out, shard_mb=SHARD_MB, block_mb=0.002, progress=False, **kw
    )  # (blocks of a few documents, several to a shard)


def without_files(manifest: Manifest) -> dict:
    """The manifest with its shards' file names left out (a merged dataset's lie in the part folders)."""
    return {
        key: {split: [{**vars(s), "file": None} for s in shards] for split, shards in value.items()}
        if key == "splits"
        else value
        for key, value in vars(manifest).items()
    }


@pytest.fixture(scope="module")
def one_run(corpus, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "shards"
    return out, shard(corpus, tiny_data, out, workers=1)


@pytest.fixture(scope="module", params=[2, 3])
def merged(request, corpus, tiny_data, tmp_path_factory):
    """(directory, manifest, N): the input as N parts, merged."""
    n = request.param
    out = tmp_path_factory.mktemp(f"parts{n}") / "shards"
    for k in range(1, n + 1):
        part = shard(corpus, tiny_data, out, part=(k, n), workers=2 if k == 1 else 1)
        assert part.documents > 0, f"part {k}/{n} is empty: the test would not split the input"
    return out, merge_parts(out), n


def test_the_input_has_segments_of_every_kind(corpus):
    found = segments(corpus, int(SEGMENT_SHARDS * SHARD_MB * 2**20))
    assert len(found) >= 8
    pieces = [p for s in found for p in s.pieces]
    assert any(p.row_groups is not None and p.row_groups[0] > 0 for p in pieces)  # a parquet file cut
    assert any(len(s.pieces) > 2 for s in found)  # small files together
    assert [(p.path, p.index) for p in pieces if p.row_groups is None] == [
        (name, i) for i, name in enumerate(corpus) if not name.endswith(".parquet")
    ]


def test_parts_merged_are_the_shards_of_one_run(one_run, merged):
    """Every shard's documents, blocks and bytes (its sha256) and the manifest's counts: the same as one run's,
    whatever N; only the shards' folders differ."""
    (one_dir, one), (out, manifest, n) = one_run, merged
    assert len(one.splits["train"]) > 10 and len(one.splits["valid"]) > 3
    assert without_files(manifest) == without_files(one)
    assert {s.file.partition("/")[0] for s in manifest.splits["train"]} == {part_name((k, n)) for k in range(1, n + 1)}
    for split in ("train", "valid"):
        for mine, theirs in zip(manifest.splits[split], one.splits[split]):
            assert (out / mine.file).read_bytes() == (one_dir / theirs.file).read_bytes()


def test_parts_merged_train_the_rows_of_one_run(one_run, merged, tok):
    """A loader (four shuffled streams, two ranks) reads the same rows from both, batch for batch."""
    (one_dir, _), (out, _, _) = one_run, merged
    for rank in range(2):
        batches = [
            take(build_loader(loader_settings(d, seed=3, streams=4), "train", 4, rank, 2, tok), 12)
            for d in (one_dir, out)
        ]
        assert len(batches[0]) == 12 and torch.unique(batches[0][0]["input_ids"]).numel() > 20
        assert_same_batches(*batches)


def test_parts_hold_equal_shares_of_the_tokens_within_a_segment(corpus, one_run, merged):
    """Part K holds the segments whose text starts in the K-th of N equal ranges of the input's text: its
    tokens are within a segment's (and a quarter: the text of these files tracks their tokens) of 1/N of them."""
    (_, one), (_, manifest, n) = one_run, merged
    found = segments(corpus, int(SEGMENT_SHARDS * SHARD_MB * 2**20))
    total = sum(s.tokens for shards in one.splits.values() for s in shards)
    per_segment = total * max(s.size for s in found) / sum(s.size for s in found)
    for k in range(1, n + 1):
        mine = [s for shards in manifest.splits.values() for s in shards if s.file.startswith(part_name((k, n)))]
        assert abs(sum(s.tokens for s in mine) - total / n) <= 1.25 * per_segment, (k, n, total)
        assert part_segments(found, (k, n))


def test_merge_refuses_parts_cut_into_other_shards(corpus, tiny_data, tmp_path):
    """Parts of another --shard-mb, or an older part whose record does not say it, are cut elsewhere."""
    out = tmp_path / "shards"
    shard(corpus, tiny_data, out, part=(1, 2), workers=1)
    write_shards(corpus, str(tiny_data.tokenizer), out, shard_mb=2 * SHARD_MB, part=(2, 2), progress=False, workers=1)
    refused = r"part-00001-of-00002 and .*part-00002-of-00002 were made with different settings: .*'shard_mb'"
    with pytest.raises(DataError, match=refused):
        merge_parts(out)
    shard(corpus, tiny_data, out, part=(2, 2), workers=1, overwrite=True)
    record = out / part_name((2, 2)) / PART_RECORD
    older = json.loads(record.read_text())
    del older["settings"]["shard_mb"], older["settings"]["block_mb"]
    record.write_text(json.dumps(older))
    with pytest.raises(DataError, match=refused.replace("shard_mb", "block_mb")):
        merge_parts(out)
