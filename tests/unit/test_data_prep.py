"""Preparing data: demo corpus, tokenizer (ours and foreign tokenizer.json files), document sources,
shard writing with its manifest and its refusals, and the `megatransformer data` CLI."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
from support.data import shard_documents

from data_pipeline import DataError
from data_pipeline.corpus import write_demo_corpus
from data_pipeline.documents import DecodeStats, Reading, read_documents
from data_pipeline.shard import Block, Manifest, ShardWriter, default_workers, write_shards
from data_pipeline.tokenizer import file_sha256, load_tokenizer, train_tokenizer
from megatransformer.cli import main

# ------------------------------------------------------------------------------------ corpus, tokenizer


def test_demo_corpus_is_deterministic_and_bounded(tmp_path, tiny_data):
    a = write_demo_corpus(tmp_path / "a.txt", max_bytes=50_000)
    b = write_demo_corpus(tmp_path / "b.txt", max_bytes=50_000)
    assert a.read_bytes() == b.read_bytes()
    assert 50_000 <= a.stat().st_size < 70_000
    docs = list(read_documents([str(a)]))
    assert len(docs) > 20 and all(len(d.text) >= 100 for d in docs)
    assert tiny_data.corpus.read_text().startswith(a.read_text()[:1000])


def test_trained_tokenizer_has_every_special_token(tok, tiny_data):
    assert tok.vocab_size == 512
    ids = [tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.mask_id]
    assert None not in ids and len(set(ids)) == 5
    assert len(tok.sentinel_ids) == 100 and len(set(tok.sentinel_ids)) == 100
    assert set(ids) | set(tok.sentinel_ids) <= tok.special_ids
    assert tok.sha256 == file_sha256(tiny_data.tokenizer)
    assert tok.tokenizer.token_to_id("<extra_id_7>") == tok.sentinel_ids[7]


def test_tokenizer_round_trips_text(tok):
    text = "def f(x):\n    return x ** 2  # naïve — ünïcødé, tabs\tand emoji 🙂"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert not set(ids) & tok.special_ids  # special tokens never come out of plain text
    assert tok.decode([tok.eos_id]) == "</s>"


def test_foreign_tokenizer_ids_are_read_not_assumed(tmp_path):
    """A BERT-style tokenizer.json with other names and ids for the special tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"hello": 0, "world": 1, "[UNK]": 2, "[SEP]": 3, "[CLS]": 4, "[MASK]": 5, "[PAD]": 6}
    t = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.add_special_tokens(["[PAD]", "[CLS]", "[SEP]", "[MASK]", "[UNK]"])
    t.save(str(tmp_path / "bert.json"))
    info = load_tokenizer(tmp_path / "bert.json")
    assert (info.pad_id, info.bos_id, info.eos_id, info.unk_id, info.mask_id) == (6, 4, 3, 2, 5)
    assert info.sentinel_ids == [] and info.special_ids == {2, 3, 4, 5, 6}
    assert info.encode("hello world") == [0, 1]
    with pytest.raises(DataError, match="needs 1 sentinel tokens|sentinel"):
        from data_pipeline.objectives import SpanCorruption
        from data_pipeline.settings import ObjectiveArgs

        SpanCorruption(16, info, True, ObjectiveArgs())


def test_tokenizer_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(DataError, match="not a Hugging Face tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    (tmp_path / "c.txt").write_text("some text\n")
    with pytest.raises(DataError, match="too small"):
        train_tokenizer([str(tmp_path / "c.txt")], 300, tmp_path / "t.json")
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(DataError, match="no documents"):
        train_tokenizer([str(tmp_path / "empty.txt")], 400, tmp_path / "t.json")
    assert not (tmp_path / "t.json").exists()


# ------------------------------------------------------------------------------------ sources


def test_sources_txt_blocks_files_jsonl_and_compression(tmp_path):
    import zstandard

    (tmp_path / "a.txt").write_text("first doc\nline two\n\n\n second doc \n\n")
    with gzip.open(tmp_path / "b.txt.gz", "wt") as f:
        f.write("gz doc\n\ngz doc 2\n")
    records = [{"text": "json one"}, {"text": ""}, {"body": "x", "text": "json two"}]
    raw = "\n".join(json.dumps(r) for r in records).encode()
    (tmp_path / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "other field"}) + "\n")
    files = [str(tmp_path / n) for n in ("a.txt", "b.txt.gz", "c.jsonl.zst")]
    assert [d.text for d in read_documents(files)] == [
        "first doc\nline two",
        " second doc ",
        "gz doc",
        "gz doc 2",
        "json one",
        "json two",
    ]
    assert [d.text for d in read_documents([files[0]], doc_per="file")] == ["first doc\nline two\n\n\n second doc"]
    assert [d.text for d in read_documents([str(tmp_path / "d.jsonl")], text_field="body")] == ["other field"]
    with pytest.raises(DataError, match=r"d.jsonl:1: no 'text' field"):
        list(read_documents([str(tmp_path / "d.jsonl")]))
    (tmp_path / "e.jsonl").write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(DataError, match=r"e.jsonl:2: invalid JSON"):
        list(read_documents([str(tmp_path / "e.jsonl")]))


def test_undecodable_bytes_replace_and_count_or_fail_with_file_and_line(tmp_path):
    (tmp_path / "bad.txt").write_bytes(b"good line\n\nbad \xff\xfe line\nmore\n")
    stats = DecodeStats()
    docs = list(read_documents([str(tmp_path / "bad.txt")], stats=stats))
    assert docs[1].text == "bad \ufffd\ufffd line\nmore" and stats.replaced_lines == 1
    with pytest.raises(DataError, match=r"bad.txt:3: not UTF-8"):
        list(read_documents([str(tmp_path / "bad.txt")], on_decode_error="fail"))


# ------------------------------------------------------------------------------------ shards


def test_manifest_describes_the_shards(tiny_data, tok):
    m = Manifest.load(tiny_data.shards)
    assert m.tokenizer_sha256 == tok.sha256 and m.vocab_size == 512 and m.dtype == "uint16"
    assert m.eos_id == tok.eos_id and m.version == 2
    docs = list(read_documents([str(tiny_data.corpus)]))
    assert m.documents == len(docs)
    assert sum(s.documents for s in m.splits["valid"]) == len(docs) // 10
    assert len(m.splits["train"]) >= 8
    for shard in m.splits["train"][:3] + m.splits["valid"][:1]:
        path = tiny_data.shards / shard.file
        assert file_sha256(path) == shard.sha256 and path.stat().st_size == shard.bytes
        blocks = shard_blocks(path)
        assert len(blocks) == shard.samples > 1 and all(b.keys() == {"ids.npy", "offsets.npy"} for b in blocks)
        assert sum(len(b["offsets.npy"]) - 1 for b in blocks) == shard.documents
        assert sum(len(b["ids.npy"]) for b in blocks) == shard.tokens and blocks[0]["ids.npy"].dtype == np.uint16
    # the first training documents, exactly
    first = shard_blocks(tiny_data.shards / m.splits["train"][0].file)[0]
    ids, offsets = first["ids.npy"], first["offsets.npy"]
    assert [tok.decode(d.tolist()) for d in np.split(ids, offsets[1:-1])] == [d.text for d in docs[: len(offsets) - 1]]
    assert not list(tiny_data.shards.glob(".*"))  # no temporary files left


def shard_blocks(path) -> list[dict]:
    """A shard's samples as the ``webdataset`` package reads them (arrays decoded, keys dropped)."""
    import webdataset as wds

    samples = wds.WebDataset(str(path), shardshuffle=False).decode()
    return [{k: v for k, v in s.items() if not k.startswith("__")} for s in samples]


def test_blocks_hold_whole_documents_and_round_trip(tmp_path):
    """Documents cut into blocks that reach the block size (the last one smaller), whatever batches they
    arrive in; each block read back is the documents written, with their prompt lengths."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(0, 300, 200)
    docs = [rng.integers(0, 60_000, n).astype(np.uint16) for n in lengths]
    prompts = np.minimum(lengths, 7)
    written = []
    for arrival in ([200], [1] * 200, [50, 3, 100, 47]):
        out = tmp_path / f"arrival-{len(arrival)}"
        out.mkdir()
        writer = ShardWriter(out, "train", max_bytes=40_000, block_bytes=4096)
        first = 0
        for n in arrival:
            part = docs[first : first + n]
            writer.write(
                np.concatenate(part),
                lengths[first : first + n],
                np.arange(first, first + n),
                prompts[first : first + n],
            )
            first += n
        writer.close()
        blocks = [Block.from_sample(s) for info in writer.shards for s in tar_samples(out / info.file)]
        assert sum(len(b) for b in blocks) == 200 == sum(info.documents for info in writer.shards)
        assert all(len(b.ids) * 2 >= 4096 for b in blocks[:-1]) and len(writer.shards) > 1
        assert all(len(b.ids[: b.offsets[-2]]) * 2 < 4096 for b in blocks)  # the fewest documents that reach it
        read = [(b.ids[b.offsets[i] : b.offsets[i + 1]], b.prompt_lens[i]) for b in blocks for i in range(len(b))]
        assert all(np.array_equal(r, d) and p == q for (r, p), d, q in zip(read, docs, prompts))
        written.append([info.sha256 for info in writer.shards])
    assert written[0] == written[1] == written[2]


def tar_samples(path) -> list[dict[str, bytes]]:
    import webdataset as wds

    return list(wds.WebDataset(str(path), shardshuffle=False))


def test_malformed_blocks_are_refused():
    ids = np.arange(10, dtype=np.uint16)
    good = Block(ids, np.array([0, 4, 10])).sample("k")
    assert Block.from_sample(good).offsets.tolist() == [0, 4, 10]
    for offsets in ([0, 4, 9], [1, 4, 10], [0, 6, 4, 10]):
        with pytest.raises(DataError, match="offsets"):
            Block.from_sample({**good, "offsets.npy": Block(ids, np.array(offsets)).sample("k")["offsets.npy"]})


def test_compressed_shards_hold_the_same_documents_in_fewer_bytes(tmp_path, tiny_data):
    """--compress zstd: every member of a sample compressed (``*.npy.zst``), recorded in the manifest; the
    documents read back are the uncompressed directory's, and the tars stay plain WebDataset."""
    text = tiny_data.corpus.read_text()[:60_000]
    (tmp_path / "c.txt").write_text(text)
    kw = {"shard_mb": 0.02, "block_mb": 0.005, "workers": 1, "progress": False}
    plain = write_shards([str(tmp_path / "c.txt")], str(tiny_data.tokenizer), tmp_path / "plain", **kw)
    packed = write_shards(
        [str(tmp_path / "c.txt")], str(tiny_data.tokenizer), tmp_path / "zstd", compression="zstd", **kw
    )
    assert (plain.compression, packed.compression) == (None, "zstd")
    assert Manifest.load(tmp_path / "zstd").compression == "zstd"
    for split in ("train", "valid"):  # the same blocks (cut by the ids' size), fewer shards (cut by their size)
        totals = [
            [sum(getattr(s, n) for s in m.splits[split]) for n in ("samples", "documents", "tokens")]
            for m in (plain, packed)
        ]
        assert totals[0] == totals[1]
    assert len(packed.splits["train"]) < len(plain.splits["train"])
    assert packed.bytes_per_token() < 0.8 * plain.bytes_per_token()
    samples = tar_samples(tmp_path / "zstd" / packed.splits["train"][0].file)
    assert {name for name in samples[0] if not name.startswith("__")} == {"ids.npy.zst", "offsets.npy.zst"}
    for split in ("train", "valid"):
        assert shard_documents(tmp_path / "zstd", split) == shard_documents(tmp_path / "plain", split)


def test_compression_refusals_and_a_corrupt_member():
    ids = np.arange(10, dtype=np.uint16)
    sample = Block(ids, np.array([0, 4, 10]), np.array([1, 2])).sample("k", compression="zstd")
    assert set(sample) == {"__key__", "ids.npy.zst", "offsets.npy.zst", "prompt_lens.npy.zst"}
    block = Block.from_sample(sample)
    assert block.ids.tolist() == ids.tolist() and block.prompt_lens.tolist() == [1, 2]
    assert Block.documents_in(sample) == 2 and Block.documents_in(Block(ids, np.array([0, 10])).sample("k", 1)) == 1
    with pytest.raises(DataError, match=r"a sample's ids\.npy\.zst is not valid zstd"):
        Block.from_sample({**sample, "ids.npy.zst": sample["ids.npy.zst"][:-5]})
    with pytest.raises(DataError, match=r"a sample's offsets\.npy\.zst is not valid zstd"):
        Block.documents_in({**sample, "offsets.npy.zst": b"not zstd"})
    with pytest.raises(DataError, match=r"--compress lz4 is not a compression this code writes \(none, zstd\)"):
        write_shards(["x.txt"], "tok.json", "out", compression="lz4")
    with pytest.raises(DataError, match="compressed shards are format 2"):
        write_shards(["x.txt"], "tok.json", "out", compression="zstd", version=1)


def test_a_manifest_of_an_unknown_compression_is_refused(tmp_path, tiny_data):
    raw = json.loads((tiny_data.shards / "manifest.json").read_text())
    (tmp_path / "manifest.json").write_text(json.dumps({**raw, "compression": "brotli"}))
    with pytest.raises(DataError, match="compressed with 'brotli', this code reads zstd or uncompressed ones"):
        Manifest.load(tmp_path)


def test_format_1_directories_still_load(tmp_path, tiny_data):
    """A directory written in format 1 (one document per sample) reads as the same documents."""
    from data_pipeline.loader.blocks import ShardOpener
    from data_pipeline.loader.reader import DocumentReader, Position
    from data_pipeline.loader.sources import resolve_datasets
    from data_pipeline.remote import Retry

    text = tiny_data.corpus.read_text()[:40_000]
    (tmp_path / "c.txt").write_text(text)
    kw = {"shard_mb": 0.01, "workers": 1, "progress": False, "valid_every": 0}
    old = write_shards([str(tmp_path / "c.txt")], str(tiny_data.tokenizer), tmp_path / "v1", version=1, **kw)
    assert old.version == 1 and all(s.samples == s.documents for s in old.splits["train"])
    raw = json.loads((tmp_path / "v1" / "manifest.json").read_text())
    for shard in raw["splits"]["train"]:  # as the older code wrote it
        del shard["documents"], shard["bytes"]
    (tmp_path / "v1" / "manifest.json").write_text(json.dumps(raw))
    assert set(shard_blocks(tmp_path / "v1" / old.splits["train"][0].file)[0]) == {"ids.npy"}

    def documents(directory):
        (shard_set,) = resolve_datasets(str(directory), "train", Retry())
        reader = DocumentReader(shard_set, 0, 0, 1, False, 4, ShardOpener("error", Retry()), 1)
        return [tokens.tolist() for tokens, _, _ in reader.documents(Position())]

    new = write_shards([str(tmp_path / "c.txt")], str(tiny_data.tokenizer), tmp_path / "v2", **kw)
    assert new.version == 2 and len(new.splits["train"]) < len(old.splits["train"])
    assert documents(tmp_path / "v1") == documents(tmp_path / "v2")
    assert len(documents(tmp_path / "v1")) == old.documents


@pytest.mark.parametrize(
    "name", ["../../../../etc/passwd", "/etc/passwd", "part-00001-of-00002/../../x.tar", "a\\b.tar", "a//b", "..", ""]
)
def test_a_manifest_entry_outside_the_shard_directory_is_refused(tmp_path, tiny_data, name):
    raw = json.loads((tiny_data.shards / "manifest.json").read_text())
    raw["splits"]["train"][0]["file"] = name
    (tmp_path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(DataError, match="not a path inside the shard directory") as err:
        Manifest.load(tmp_path)
    assert len(str(err.value).splitlines()) == 1 and repr(name) in str(err.value)


def test_large_vocab_shards_are_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"</s>": 70_000, "<unk>": 70_001}
    t = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Whitespace()
    t.save(str(tmp_path / "big.json"))
    (tmp_path / "c.txt").write_text("w1 w69999 w5\n\nw2\n")
    m = write_shards(
        [str(tmp_path / "c.txt")], str(tmp_path / "big.json"), tmp_path / "s", valid_every=0, workers=1, progress=False
    )
    assert m.dtype == "uint32"
    (block,) = shard_blocks(tmp_path / "s" / m.splits["train"][0].file)
    assert block["ids.npy"].dtype == np.uint32 and block["ids.npy"].tolist() == [1, 69999, 5, 2]
    assert block["offsets.npy"].tolist() == [0, 3, 4]


def test_parallel_workers_write_the_same_shards(tmp_path, tiny_data):
    text = tiny_data.corpus.read_text()[:40_000]
    (tmp_path / "c.txt").write_text(text)
    one = write_shards(
        [str(tmp_path / "c.txt")], str(tiny_data.tokenizer), tmp_path / "one", shard_mb=0.01, workers=1, progress=False
    )
    two = write_shards(
        [str(tmp_path / "c.txt")], str(tiny_data.tokenizer), tmp_path / "two", shard_mb=0.01, workers=2, progress=False
    )
    assert one.splits == two.splits  # same files, counts and checksums


def test_by_default_a_small_plain_input_is_tokenized_without_a_process_a_core(tmp_path, monkeypatch):
    """15 tokenizer processes for a 1.4 MB corpus on a 16-core machine took longer to start than the text did."""
    monkeypatch.setattr("data_pipeline.shard.os.cpu_count", lambda: 16)
    files = {"small.txt": 1_400_000, "ten.jsonl": 10 * 2**20, "large.txt": 200 * 2**20, "small.txt.zst": 1_400_000}
    for name, size in files.items():
        with open(tmp_path / name, "wb") as f:
            f.truncate(size)

    def workers(name: str) -> int:
        return default_workers(Reading([str(tmp_path / name)]))

    assert workers("small.txt") == 1  # one batch of BATCH_CHARS: in this process
    assert workers("ten.jsonl") == 5  # a process a batch
    assert workers("large.txt") == 15  # a process a core, the main one's left to read and write
    assert workers("small.txt.zst") == 15  # (compressed: its bytes say less than its text)


def test_refuses_an_existing_dataset_unless_overwrite(tmp_path, tiny_data):
    (tmp_path / "c.txt").write_text("one document\n\nanother one\n")
    args = ([str(tmp_path / "c.txt")], str(tiny_data.tokenizer), tmp_path / "out")
    write_shards(*args, valid_every=0, workers=1, progress=False)
    with pytest.raises(DataError, match="already holds a dataset.*--overwrite"):
        write_shards(*args, valid_every=0, workers=1, progress=False)
    m = write_shards(*args, valid_every=0, workers=1, progress=False, overwrite=True)
    assert m.documents == 2


def test_empty_or_failing_input_leaves_nothing_that_looks_complete(tmp_path, tiny_data):
    (tmp_path / "empty.txt").write_text("\n\n  \n")
    with pytest.raises(DataError, match="no documents"):
        write_shards([str(tmp_path / "empty.txt")], str(tiny_data.tokenizer), tmp_path / "e", workers=1, progress=False)
    assert not list((tmp_path / "e").iterdir())
    # a decode failure half way: the shards written so far are removed, no manifest appears
    good = tiny_data.corpus.read_text()[:30_000]
    (tmp_path / "late.txt").write_bytes(good.encode() + b"\n\nbroken \xff\n")
    with pytest.raises(DataError, match=r"late.txt:\d+: not UTF-8"):
        write_shards(
            [str(tmp_path / "late.txt")],
            str(tiny_data.tokenizer),
            tmp_path / "f",
            shard_mb=0.005,
            on_decode_error="fail",
            workers=1,
            progress=False,
        )
    assert not list((tmp_path / "f").iterdir())


# ------------------------------------------------------------------------------------ CLI


def test_cli_prepares_a_dataset_end_to_end(tmp_path, capsys):
    corpus, tok_path, out = tmp_path / "c.txt", tmp_path / "tok.json", tmp_path / "shards"
    assert main(["data", "demo-corpus", "--out", str(corpus), "--max-mb", "0.05"]) == 0
    assert (
        main(
            [
                "data",
                "tokenizer",
                "--input",
                str(corpus),
                "--vocab-size",
                "400",
                "--sentinels",
                "10",
                "--out",
                str(tok_path),
            ]
        )
        == 0
    )
    assert "10 sentinels" in capsys.readouterr().out
    assert (
        main(
            [
                "data",
                "shard",
                "--input",
                str(corpus),
                "--tokenizer",
                str(tok_path),
                "--out",
                str(out),
                "--shard-mb",
                "0.01",
                "--valid-every",
                "5",
                "--workers",
                "1",
            ]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "train:" in printed and "valid:" in printed
    assert Manifest.load(out).tokenizer_sha256 == file_sha256(tok_path)
    # refusing to overwrite: exit code 2 and one line naming the fix
    assert main(["data", "shard", "--input", str(corpus), "--tokenizer", str(tok_path), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--overwrite" in err
    assert (
        main(
            [
                "data",
                "shard",
                "--input",
                str(tmp_path / "nope.txt"),
                "--tokenizer",
                str(tok_path),
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert "nope.txt does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_the_reader_in_docs_reads_the_shards(tiny_data, tok, capsys, tmp_path, compression):
    """docs/data.md's few-line reader (the webdataset package), run on a shard directory as written there,
    plain and compressed."""
    import re

    from support import REPO
    from support.data import reformat_shards

    shards = (
        tiny_data.shards
        if compression is None
        else reformat_shards(tiny_data.shards, tmp_path / "s", 2, 4096, compression)
    )
    text = (REPO / "docs" / "data.md").read_text()
    code = re.search(r"```python\n(.*?)```", text[text.index("## The shard format") :], re.S).group(1)
    exec(code, {"directory": str(shards)})
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == Manifest.load(shards).splits["train"][0].documents
    first = tok.encode(next(iter(read_documents([str(tiny_data.corpus)]))).text)
    assert lines[0] == f"{len(first)} {np.array(first[:8], dtype=np.uint16)}"


def test_progress_bar_counts_input_bytes_documents_and_tokens(tmp_path, tiny_data, capsys):
    text = tiny_data.corpus.read_text()[:40_000]
    (tmp_path / "c.txt").write_text(text)
    m = write_shards([str(tmp_path / "c.txt")], str(tiny_data.tokenizer), tmp_path / "s", workers=1, progress=True)
    bar = capsys.readouterr().err.split("\r")[-1]
    size = (tmp_path / "c.txt").stat().st_size
    assert "100%" in bar and f"{size / 1000:.1f}k/{size / 1000:.1f}k" in bar and "B/s" in bar
    assert f"{m.documents:,} documents, {sum(m.tokens(s) for s in m.splits):,} tokens" in bar
