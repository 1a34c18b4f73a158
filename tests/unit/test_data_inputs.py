"""The inputs people have (.parquet, `datasets` directories) and tokenizing one input as N parts joined by
`data merge`: the same documents, in the same splits, as one run; parts that are missing, unfinished,
damaged, doubled or made differently are refused, naming them."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from support.data import shard_documents

from data_pipeline import DataError, documents
from data_pipeline.documents import input_files, read_documents
from data_pipeline.merge import merge_parts
from data_pipeline.parts import PART_RECORD, parse_part, part_name, part_segments, segments, text_sizes
from data_pipeline.shard import MANIFEST, Manifest, write_shards
from megatransformer.cli import main


def write_parquet(path, rows: dict[str, list], row_group_size: int = 7):
    pq.write_table(pa.table(rows), path, row_group_size=row_group_size)
    return path


def write_saved_dataset(directory, rows: dict[str, list], files: int = 2):
    """A directory laid out as `datasets.Dataset.save_to_disk` writes it: Arrow IPC stream files, state.json
    listing them, dataset_info.json."""
    directory.mkdir()
    table = pa.table(rows)
    names = [f"data-{i:05d}-of-{files:05d}.arrow" for i in range(files)]
    step = -(-len(table) // files)
    for i, name in enumerate(names):
        with pa.ipc.new_stream(directory / name, table.schema) as writer:
            writer.write_table(table.slice(i * step, step), max_chunksize=3)
    (directory / "state.json").write_text(
        json.dumps({"_data_files": [{"filename": n} for n in names], "_fingerprint": "0", "_split": None})
    )
    (directory / "dataset_info.json").write_text(json.dumps({"features": {"text": {"dtype": "string"}}}))
    return directory


def test_parquet_documents_come_row_group_by_row_group_from_the_chosen_column(tmp_path):
    texts = [f"  document {i}  " if i % 5 else "" for i in range(30)] + [None]
    path = write_parquet(tmp_path / "a.parquet", {"id": list(range(31)), "body": texts})
    assert pq.ParquetFile(path).num_row_groups == 5
    docs = list(read_documents([str(path)], text_field="body"))
    assert [d.text for d in docs] == [t.strip() for t in texts if t and t.strip()]
    assert [d.line for d in docs] == [i + 1 for i in range(30) if i % 5]  # the row, from 1
    assert [d.number for d in docs] == [d.line - 1 for d in docs]  # the row's index: the same in any part


def test_parquet_instruction_examples(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", {"q": ["Say hi:", "Count:", ""], "a": [" hi", " 1 2", ""]})
    docs = list(read_documents([str(path)], text_field="a", prompt_field="q"))
    assert [(d.prompt, d.text) for d in docs] == [("Say hi:", " hi"), ("Count:", " 1 2")]


def test_parquet_without_the_column_names_the_file_and_its_columns(tmp_path):
    path = write_parquet(tmp_path / "a.parquet", {"id": [1, 2], "content": ["x", "y"]})
    with pytest.raises(DataError, match=r"a\.parquet: no column 'text' \(it has id, content\); choose one with"):
        list(read_documents([str(path)]))
    with pytest.raises(DataError, match=r"a\.parquet: column 'id' holds int64, not text"):
        list(read_documents([str(path)], text_field="id"))


def test_corrupt_and_truncated_parquet_name_the_file(tmp_path):
    good = write_parquet(tmp_path / "good.parquet", {"text": [f"doc {i}" for i in range(50)]})
    (tmp_path / "cut.parquet").write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    (tmp_path / "junk.parquet").write_bytes(b"not a parquet file at all" * 10)
    for name in ("cut.parquet", "junk.parquet"):
        with pytest.raises(DataError, match=rf"{name}: not a readable \.parquet file") as err:
            list(read_documents([str(tmp_path / name)]))
        assert "\n" not in str(err.value)


def test_parquet_is_streamed_a_batch_at_a_time(tmp_path, monkeypatch):
    """Documents of the first row groups come out before the last one is read: damaged, it fails only then."""
    monkeypatch.setattr(documents, "BATCH_ROWS", 100)
    path = write_parquet(tmp_path / "a.parquet", {"text": [f"document {i} " * 20 for i in range(600)]}, 200)
    chunk = pq.ParquetFile(path).metadata.row_group(2).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    data = bytearray(path.read_bytes())
    data[start + 40 : start + chunk.total_compressed_size - 10] = b"Z" * (chunk.total_compressed_size - 50)
    path.write_bytes(data)
    docs = read_documents([str(path)])
    assert [next(docs).line for _ in range(400)] == list(range(1, 401))
    with pytest.raises(DataError, match=r"a\.parquet: not a readable \.parquet file"):
        next(docs)


def test_saved_datasets_directory_is_read_in_its_row_order(tmp_path):
    texts = [f"row {i}" for i in range(11)]
    saved = write_saved_dataset(tmp_path / "saved", {"text": texts, "n": list(range(11))})
    files = input_files([str(saved)])
    assert [p.rsplit("/", 1)[1] for p in files] == ["data-00000-of-00002.arrow", "data-00001-of-00002.arrow"]
    assert [d.text for d in read_documents(files)] == texts
    with pytest.raises(DataError, match=r"data-00000-of-00002\.arrow: no column 'body' \(it has text, n\)"):
        list(read_documents(files, text_field="body"))

    (tmp_path / "dict").mkdir()
    shutil.copytree(saved, tmp_path / "dict" / "train")
    (tmp_path / "dict" / "dataset_dict.json").write_text(json.dumps({"splits": ["train"]}))
    with pytest.raises(DataError, match=r"is a datasets DatasetDict \(splits: train\); give one split's directory"):
        input_files([str(tmp_path / "dict")])


def test_parquet_files_in_a_directory_are_found_like_jsonl_ones(tmp_path):
    write_parquet(tmp_path / "b.parquet", {"text": ["b"]})
    (tmp_path / "a.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "notes.md").write_text("not an input")
    assert input_files([str(tmp_path)]) == [str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet")]


def test_tokenizer_learns_from_a_parquet_column(tiny_data, tmp_path):
    from data_pipeline.tokenizer import train_tokenizer

    docs = [d.text for d in read_documents([str(tiny_data.corpus)])][:200]
    write_parquet(tmp_path / "a.parquet", {"content": docs, "other": ["zzzz"] * len(docs)}, 50)
    info = train_tokenizer(input_files([str(tmp_path)]), 400, tmp_path / "tok" / "tokenizer.json", 0, "content")
    assert info.vocab_size == 400
    learned, other = info.encode_batch(["the function returns", "zzzz"])
    assert len(learned) < len("the function returns") and len(other) == 4  # from "content" only


def test_parse_part():
    assert parse_part("3/8") == (3, 8)
    for bad in ("0/2", "3/2", "2", "a/b", "1/0"):
        with pytest.raises(ValueError, match="is not K/N"):
            parse_part(bad)


@pytest.fixture(scope="module")
def inputs(tiny_data, tmp_path_factory):
    """The demo corpus's documents spread over five files of every kind."""
    root = tmp_path_factory.mktemp("inputs")
    docs = [d.text for d in read_documents([str(tiny_data.corpus)])][:500]
    chunks = [docs[i::5] for i in range(5)]
    (root / "a.txt").write_text("\n\n".join(chunks[0]))
    with gzip.open(root / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in chunks[1])
    write_parquet(root / "c.parquet", {"text": chunks[2]}, row_group_size=16)
    (root / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in chunks[3]))
    write_parquet(root / "e.parquet", {"text": chunks[4]}, row_group_size=40)
    return input_files([str(root)])


def shard(inputs, tiny_data, out, **kw):
    return write_shards(inputs, str(tiny_data.tokenizer), out, shard_mb=0.02, workers=1, progress=False, **kw)


def test_parts_merged_hold_the_documents_and_splits_of_one_run(inputs, tiny_data, tmp_path):
    one = shard(inputs, tiny_data, tmp_path / "one")
    for n in (2, 7):  # 7: more parts than files
        out = tmp_path / f"in{n}"
        for k in range(1, n + 1):
            shard(inputs, tiny_data, out, part=(k, n))
            assert not (out / MANIFEST).exists()
            with pytest.raises(DataError, match=r"has no manifest\.json"):
                Manifest.load(out / part_name((k, n)))  # a part alone is not a dataset
        merged = merge_parts(out)
        assert merged.documents == one.documents and merged.tokenizer_sha256 == one.tokenizer_sha256
        for split in ("train", "valid"):
            docs = shard_documents(tmp_path / "one", split)
            assert len(docs) == sum(s.documents for s in one.splits[split]) > 40
            assert shard_documents(out, split) == docs
            assert merged.tokens(split) == one.tokens(split)
        assert all(s.file.startswith(f"part-00001-of-0000{n}/") for s in merged.splits["train"][:1])


def test_a_part_of_empty_files_is_finished_and_merged_with_the_others(tiny_data, tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "only one document"}\n')
    write_parquet(tmp_path / "b.parquet", {"text": ["", None, "  "]})
    files, out = input_files([str(tmp_path)]), tmp_path / "out"
    empty = shard(files, tiny_data, out, part=(2, 2), valid_every=0)
    assert (empty.documents, empty.splits) == (0, {}) and (out / part_name((2, 2)) / PART_RECORD).is_file()
    with pytest.raises(DataError, match=r"part 1/2 is missing"):
        merge_parts(out)
    shard(files, tiny_data, out, part=(1, 2), valid_every=0)
    assert merge_parts(out).documents == 1
    shard(files[1:], tiny_data, tmp_path / "none", part=(1, 1))
    with pytest.raises(DataError, match=r"no part in .*none holds a document \(empty inputs\?\)"):
        merge_parts(tmp_path / "none")


def part_pieces(files, part, segment_bytes=1):
    """The pieces of ``part`` (segments of ``segment_bytes`` of text: 1, a file or row group each)."""
    return [piece for segment in part_segments(segments(files, segment_bytes), part) for piece in segment.pieces]


def test_parts_share_out_the_input_by_bytes_splitting_parquet_files_by_row_groups(inputs):
    whole = [(d.text, d.number) for d in read_documents(inputs)]
    sizes = [text for text, _ in text_sizes(inputs)]
    split = 0
    for n in (1, 2, 3, 7, 40):
        parts = [part_pieces(inputs, (k, n)) for k in range(1, n + 1)]
        assert [(d.text, d.number) for pieces in parts for d in read_documents(pieces)] == whole
        split += sum(piece.row_groups is not None for pieces in parts for piece in pieces)
        if n <= 3:  # as even in bytes as whole files (and row groups) allow
            assert max(sum(sizes[p.index] for p in pieces if p.row_groups is None) for pieces in parts) < (
                sum(sizes) / n + max(sizes)
            )
    assert split > 5  # the parquet files were cut between parts
    assert whole[:2] == [(whole[0][0], 0), (whole[1][0], 1)]
    for segment_bytes in (1, 5_000, 10**9):  # segments of any size hold the input once, in order
        found = segments(inputs, segment_bytes)
        assert [(d.text, d.number) for s in found for d in read_documents(s.pieces)] == whole
        assert all(s.size >= segment_bytes for s in found[:-1]) and sum(s.size for s in found) == sum(sizes)


def test_parts_share_out_the_text_not_the_compressed_bytes(tiny_data, tmp_path):
    """A .jsonl.gz of repetitive text holds many times its size: shared out by bytes on disk, it and the plain
    file after it would both fall in part 1 and leave part 2 empty."""
    docs = [d.text for d in read_documents([str(tiny_data.corpus)])][:60]
    plain = "\n\n".join(docs[10:])
    (tmp_path / "b.txt").write_text(plain)
    lines: list[str] = []  # the first ten documents again and again, as long as the plain file
    while sum(map(len, lines)) <= len(plain):
        lines.append(json.dumps({"text": docs[len(lines) % 10]}) + "\n")
    with gzip.open(tmp_path / "a.jsonl.gz", "wt") as f:
        f.writelines(lines)
    files = [str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.txt")]
    assert 4 * os.path.getsize(files[0]) < os.path.getsize(files[1])
    chars = [sum(len(d.text) for d in read_documents(part_pieces(files, (k, 2)))) for k in (1, 2)]
    assert min(chars) > 0.6 * max(chars), chars
    assert [text for text, _ in text_sizes(files)] == [
        len(gzip.decompress(Path(files[0]).read_bytes())),
        os.path.getsize(files[1]),
    ]


@pytest.fixture(scope="module")
def two_parts(inputs, tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("parts") / "ds"
    for k in (1, 2):
        shard(inputs, tiny_data, out, part=(k, 2))
    return out


def copy_of(two_parts, tmp_path):
    return shutil.copytree(two_parts, tmp_path / "ds")


def test_merge_refuses_a_missing_or_unfinished_part(two_parts, tmp_path):
    out = copy_of(two_parts, tmp_path)
    (out / part_name((2, 2)) / PART_RECORD).unlink()  # as a run killed before its end leaves it
    with pytest.raises(DataError, match=r"part-00002-of-00002 has no part\.json: an unfinished part"):
        merge_parts(out)
    shutil.rmtree(out / part_name((2, 2)))
    with pytest.raises(
        DataError, match=r"part 2/2 is missing .* no .*part-00002-of-00002; run `data shard --part 2/2`"
    ):
        merge_parts(out)
    assert not (out / MANIFEST).exists()


def test_merge_refuses_a_damaged_part_naming_the_file(two_parts, tmp_path):
    out = copy_of(two_parts, tmp_path)
    shard_file = out / part_name((1, 2)) / "train-000001.tar"
    shard_file.write_bytes(shard_file.read_bytes()[:1000])
    with pytest.raises(DataError, match=r"part-00001-of-00002/train-000001\.tar has 1,000 bytes, its part record"):
        merge_parts(out)
    record = out / part_name((1, 2)) / PART_RECORD
    record.write_text(record.read_text().replace('"train-000001.tar"', '"../../train-000001.tar"'))
    with pytest.raises(DataError, match=r"part\.json does not list its shards as the files of its directory"):
        merge_parts(out)
    record.write_text(record.read_text()[:200])
    with pytest.raises(DataError, match=r"part-00001-of-00002/part\.json is not a valid part record"):
        merge_parts(out)
    assert not (out / MANIFEST).exists()


def test_merge_refuses_the_same_part_twice_and_parts_of_another_split(two_parts, tmp_path):
    out = copy_of(two_parts, tmp_path)
    shutil.copytree(out / part_name((1, 2)), out / "part-00001-of-00002-copy")
    with pytest.raises(DataError, match=r"part-00001-of-00002 and .*part-00001-of-00002-copy are both part 1/2"):
        merge_parts(out)
    shutil.rmtree(out / "part-00001-of-00002-copy")
    shutil.copytree(out / part_name((1, 2)), out / part_name((1, 3)))
    record = out / part_name((1, 3)) / PART_RECORD
    record.write_text(record.read_text().replace('"part": [\n    1,\n    2\n  ]', '"part": [1, 3]'))
    with pytest.raises(DataError, match=r"split the input into different numbers of parts \(2 and 3\)"):
        merge_parts(out)


def test_merge_refuses_parts_made_differently_naming_both(two_parts, tmp_path):
    out = copy_of(two_parts, tmp_path)
    record_file = out / part_name((2, 2)) / PART_RECORD
    original = json.loads(record_file.read_text())
    for change, message in (
        (lambda r: r["manifest"].update(tokenizer_sha256="0" * 64), "differ in tokenizer_sha256"),
        (lambda r: r["manifest"].update(version=99), "differ in version"),
        (lambda r: r["settings"].update(valid_every=50), "were made with different settings"),
        (lambda r: r["inputs"].update(sha256="0" * 64), "were made with different inputs"),
    ):
        record = json.loads(json.dumps(original))
        change(record)
        record_file.write_text(json.dumps(record))
        with pytest.raises(DataError, match=rf"part-00001-of-00002 and .*part-00002-of-00002 {message}"):
            merge_parts(out)
    assert not (out / MANIFEST).exists()


def test_merge_refuses_parts_compressed_differently_naming_both(inputs, two_parts, tiny_data, tmp_path):
    out = copy_of(two_parts, tmp_path)
    shard(inputs, tiny_data, out, part=(2, 2), compression="zstd", overwrite=True)
    with pytest.raises(
        DataError, match=r"part-00001-of-00002 and .*part-00002-of-00002 differ in compression \(None vs zstd\)"
    ):
        merge_parts(out)
    assert not (out / MANIFEST).exists()
    shard(inputs, tiny_data, out, part=(1, 2), compression="zstd", overwrite=True)
    plain = shutil.copytree(two_parts, tmp_path / "plain")
    assert merge_parts(out).compression == "zstd" and merge_parts(plain).compression is None
    assert shard_documents(out) == shard_documents(plain)


def test_nothing_written_is_lost_or_silently_replaced(inputs, two_parts, tiny_data, tmp_path):
    out = copy_of(two_parts, tmp_path)
    merged = merge_parts(out)
    assert merge_parts(out) == merged  # merging again writes the same manifest
    with pytest.raises(DataError, match=r"already holds a dataset \(manifest\.json\); pass --overwrite to re-make"):
        shard(inputs, tiny_data, out, part=(1, 2))
    (out / MANIFEST).write_text((out / MANIFEST).read_text().replace('"documents"', '"documents" ', 1))
    with pytest.raises(DataError, match=r"manifest\.json already exists and differs .* pass --overwrite"):
        merge_parts(out)
    assert merge_parts(out, overwrite=True) == merged

    shard(inputs, tiny_data, out, part=(1, 2), overwrite=True)  # re-made: the merged manifest goes with it
    assert not (out / MANIFEST).exists()
    assert merge_parts(out) == merged

    one = shard(inputs, tiny_data, tmp_path / "one")
    with pytest.raises(
        DataError, match=r"one holds the shards of a dataset written in one run; give the parts another"
    ):
        shard(inputs, tiny_data, tmp_path / "one", part=(1, 2), overwrite=True)
    assert Manifest.load(tmp_path / "one") == one


def test_cli_shard_part_then_merge(inputs, tiny_data, tmp_path, capsys):
    out = tmp_path / "ds"
    common = ["data", "shard", "--input", *inputs, "--tokenizer", str(tiny_data.tokenizer), "--out", str(out)]
    assert main([*common, "--part", "2/2", "--workers", "1"]) == 0
    assert "part 2/2 is finished; once all 2 are, join them with `megatransformer data merge" in capsys.readouterr().out
    assert main(["data", "merge", "--out", str(out)]) == 2
    assert "megatransformer data merge: error: part 1/2 is missing" in capsys.readouterr().err
    assert main([*common, "--part", "1/2", "--workers", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"sharding {len(inputs)} file(s) with {tiny_data.tokenizer}")
    assert main(["data", "merge", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("train: ") and f"wrote {out / MANIFEST}: data.train={out} reads" in printed
    with pytest.raises(SystemExit) as exit:
        main([*common, "--part", "3/2"])
    assert exit.value.code == 2
    assert "'3/2' is not K/N with 1 <= K <= N" in capsys.readouterr().err


@pytest.mark.parametrize("suffix", [".gz", ".zst"])
def test_the_byte_bar_of_a_compressed_input_moves_with_the_compressed_bytes_read(tmp_path, suffix):
    """data shard's bar (documents.Reading.position) counts a .jsonl.gz / .jsonl.zst by its compressed bytes read,
    not only once the file is done."""
    import random

    import zstandard

    from data_pipeline.documents import Reading, read_documents

    rng = random.Random(0)
    lines = "".join(json.dumps({"text": " ".join(str(rng.random()) for _ in range(50))}) + "\n" for _ in range(4000))
    path = tmp_path / f"docs.jsonl{suffix}"
    data = lines.encode()
    path.write_bytes(gzip.compress(data) if suffix == ".gz" else zstandard.ZstdCompressor().compress(data))
    reading = Reading([str(path)])
    seen = []
    for i, doc in enumerate(read_documents([str(path)])):
        reading.add(doc)
        if i % 500 == 499:
            seen.append(reading.position)
    assert 0 < seen[0] < seen[-2] < reading.total and seen == sorted(seen)
