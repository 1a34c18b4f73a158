"""Damaged and hostile data, crafted here, small: shards whose members, ids or counts lie, manifests of the wrong
types, inputs that are garbled, nested, bombs or outside their directory, and parts that lie about themselves.
Each is refused in one line naming the file (or read, where it is valid), never a traceback, a blown memory or
rows that train on nothing."""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
import zstandard
from support.data import loader_settings, shard_documents, take

from data_pipeline import DataError, documents
from data_pipeline.documents import read_documents
from data_pipeline.loader import build_loader
from data_pipeline.loader import reader as loader_reader
from data_pipeline.merge import merge_parts
from data_pipeline.parts import PART_RECORD
from data_pipeline.shard import INSTRUCTIONS, MANIFEST, TEXT, Block, Manifest, ShardInfo, write_shards
from data_pipeline.tokenizer import file_sha256
from megatransformer.cli import main

# ------------------------------------------------------------------------------------ crafted shards


def crafted(
    directory: Path,
    tok,
    samples: list[dict[str, bytes]],
    documents: int,
    tokens: int,
    kind: str = TEXT,
    compression: str | None = None,
) -> Path:
    """A shard directory whose one train shard holds ``samples``, its manifest saying they hold ``documents``
    documents of ``tokens`` tokens."""
    directory.mkdir()
    shard = directory / "train-000000.tar"
    with wds.TarWriter(str(shard)) as tar:
        for i, sample in enumerate(samples):
            tar.write({"__key__": f"{i:012d}", **sample})
    info = ShardInfo(shard.name, len(samples), tokens, file_sha256(shard), documents, shard.stat().st_size)
    manifest = Manifest(tok.sha256, tok.vocab_size, "uint16", tok.eos_id, {"train": [info]}, documents=documents)
    manifest.kind, manifest.compression = kind, compression
    manifest.save(directory)
    return directory


def crafted_blocks(directory: Path, tok, blocks: list[Block], compression: str | None = None, **kw) -> Path:
    """A shard directory of ``blocks`` written as ShardWriter writes them, its manifest telling the truth."""
    samples = [block.sample(f"{i:012d}", compression=compression) for i, block in enumerate(blocks)]
    samples = [{k: v for k, v in s.items() if k != "__key__"} for s in samples]
    documents, tokens = sum(len(b) for b in blocks), sum(len(b.ids) for b in blocks)
    return crafted(directory, tok, samples, documents, tokens, compression=compression, **kw)


def text_block(n_docs: int = 20, length: int = 30, seed: int = 0) -> Block:
    ids = np.random.default_rng(seed).integers(10, 500, n_docs * length).astype(np.uint16)
    return Block(ids, np.arange(0, n_docs * length + 1, length))


def npy(array: np.ndarray) -> bytes:
    import io

    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


def first_batch(directory: Path, tok, **kw):
    loader = build_loader(loader_settings(directory, seed=0, streams=1, **kw), "train", 2, 0, 1, tok, epochs=1)
    return take(loader, 1)


# ------------------------------------------------------------------------------------ zstd members


def test_a_zstd_member_is_decompressed_no_further_than_its_shard_holds(tmp_path, tok):
    block = text_block()
    sample = {k: v for k, v in block.sample("k", compression="zstd").items() if k != "__key__"}
    sample["ids.npy.zst"] = zstandard.ZstdCompressor().compress(npy(np.zeros(20_000_000, np.uint16)))  # 40 MB
    assert len(sample["ids.npy.zst"]) < 10_000
    directory = crafted(tmp_path / "bomb", tok, [sample], len(block), len(block.ids), compression="zstd")
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=r"corrupt shard .*train-000000.tar: .*ids\.npy\.zst .*more than"):
            first_batch(directory, tok)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8_000_000  # the cap: what the shard holds (600 tokens), not the 40 MB the frame holds


def zstd_frame_claiming(size: int, payload: bytes) -> bytes:
    """A zstd frame whose header claims ``size`` bytes of content, holding ``payload`` as one raw block."""
    descriptor = bytes([0xC0])  # an 8-byte content size, a window descriptor follows, no checksum
    window = bytes([0x58])
    block = (1 | len(payload) << 3).to_bytes(3, "little")  # the last block, raw
    return b"\x28\xb5\x2f\xfd" + descriptor + window + size.to_bytes(8, "little") + block + payload


def test_a_zstd_frame_claiming_64_gib_is_refused_in_one_line(tmp_path, tok):
    block = text_block()
    sample = {k: v for k, v in block.sample("k", compression="zstd").items() if k != "__key__"}
    sample["offsets.npy.zst"] = zstd_frame_claiming(64 << 30, npy(block.offsets.astype(np.uint32)))
    directory = crafted(tmp_path / "claim", tok, [sample], len(block), len(block.ids), compression="zstd")
    with pytest.raises(DataError, match=r"corrupt shard .*offsets\.npy\.zst .*claims 68,719,476,736 bytes"):
        first_batch(directory, tok)


def test_zstd_frames_without_a_content_size_are_read(tmp_path, tok):
    """Streaming compressors (``zstd`` reading a pipe) leave the content size out of the frame header."""
    blocks = [text_block(seed=s) for s in range(3)]
    plain = crafted_blocks(tmp_path / "plain", tok, blocks)
    samples = []
    for block in blocks:
        sample = block.sample("k")
        stream = zstandard.ZstdCompressor(write_content_size=False)
        samples.append({f"{k}.zst": stream.compress(v) for k, v in sample.items() if k != "__key__"})
    assert zstandard.frame_content_size(samples[0]["ids.npy.zst"]) == -1
    documents = sum(len(b) for b in blocks)
    tokens = sum(len(b.ids) for b in blocks)
    streamed = crafted(tmp_path / "streamed", tok, samples, documents, tokens, compression="zstd")
    assert shard_documents(streamed) == shard_documents(plain)


# ------------------------------------------------------------------------------------ ids and counts


def test_token_ids_outside_the_vocabulary_are_refused_naming_the_shard(tmp_path, tok):
    block = text_block()
    block.ids[37] = 600  # vocabulary 512
    with pytest.raises(DataError, match=r"corrupt shard .*train-000000.tar: token id 600 .*vocabulary .*512"):
        first_batch(crafted_blocks(tmp_path / "high", tok, [block]), tok)
    signed = Block(block.ids.astype(np.int64), block.offsets)
    signed.ids[37] = -1
    with pytest.raises(DataError, match=r"corrupt shard .*train-000000.tar: .*int64 .*manifest says uint16"):
        first_batch(crafted_blocks(tmp_path / "negative", tok, [signed]), tok)


@pytest.mark.parametrize("damage", ["empty documents", "long prompts", "prompts in text", "no prompts"])
def test_blocks_that_train_on_nothing_are_refused(tmp_path, tok, damage):
    n = 5000 if damage == "empty documents" else 20
    block = Block(np.zeros(0, np.uint16), np.zeros(n + 1, np.int64)) if damage == "empty documents" else text_block()
    kind = INSTRUCTIONS if damage in ("long prompts", "no prompts") else TEXT
    if damage == "long prompts":
        block.prompt_lens = np.full(len(block), 31, np.uint32)  # documents of 30 tokens
    elif damage == "prompts in text":
        block.prompt_lens = np.full(len(block), 3, np.uint32)
    message = {
        "empty documents": "5000 empty documents",
        "long prompts": "prompt lengths longer than their examples",
        "prompts in text": "prompt lengths in a shard of text",
        "no prompts": "no prompt lengths in a shard of prompt_completion",
    }[damage]
    with pytest.raises(DataError, match=rf"corrupt shard .*train-000000.tar: .*{message}"):
        first_batch(crafted_blocks(tmp_path / "d", tok, [block], kind=kind), tok)


@pytest.mark.parametrize("lie", [-3, 3], ids=["fewer", "more"])
def test_a_shards_document_count_that_lies_is_found_before_its_rows_are_served(tmp_path, tok, monkeypatch, lie):
    monkeypatch.setattr(loader_reader, "RUN_TOKENS", 32)  # runs of a few documents: rows come before the end
    directory = crafted_blocks(tmp_path / "d", tok, [text_block(seed=s) for s in range(4)])
    assert len(first_batch(directory, tok, shuffle_buffer=1)) == 1
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["splits"]["train"][0]["documents"] += lie
    manifest["documents"] += lie
    (directory / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=rf"train-000000.tar: it holds .*80 documents.*manifest says 4 of {80 + lie}"):
        first_batch(directory, tok, shuffle_buffer=1)


# ------------------------------------------------------------------------------------ manifest schema


@pytest.mark.parametrize(
    ("where", "value", "message"),
    [
        ("documents", "7060", "documents"),
        ("dtype", "float32", "dtype"),
        ("vocab_size", -5, "vocab_size"),
        ("kind", "images", "kind"),
        ("shard.documents", "7060", r"splits\.train\.0\.documents"),
        ("shard.sha256", 5, r"splits\.train\.0\.sha256"),
        ("shard.tokens", -1, r"splits\.train\.0\.tokens"),
        ("splits", [], "splits"),
    ],
)
def test_manifest_fields_of_the_wrong_type_are_refused_naming_the_field(tiny_data, tmp_path, where, value, message):
    copy = tmp_path / "shards"
    shutil.copytree(tiny_data.shards, copy)
    raw = json.loads((copy / MANIFEST).read_text())
    if where.startswith("shard."):
        raw["splits"]["train"][0][where.removeprefix("shard.")] = value
    else:
        raw[where] = value
    (copy / MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(DataError, match=rf"{MANIFEST} is not a valid shard manifest \({message}: "):
        Manifest.load(copy)


def test_a_format_1_manifest_still_loads(tiny_data, tmp_path):
    legacy = json.loads((tiny_data.shards / MANIFEST).read_text())
    for info in legacy["splits"]["train"]:  # format 1: no documents or bytes per shard
        info.pop("documents"), info.pop("bytes")
    legacy["version"] = 1
    (tmp_path / MANIFEST).write_text(json.dumps(legacy))
    loaded = Manifest.load(tmp_path)
    assert [s.documents for s in loaded.splits["train"]] == [s.samples for s in loaded.splits["train"]]
    assert loaded.splits["train"][0].bytes is None and loaded.dtype == "uint16"


# ------------------------------------------------------------------------------------ inputs


def shard_inputs(files, tiny_data, out, **kw) -> Manifest:
    kw = {"shard_mb": 1, "valid_every": 0, "workers": 1, "progress": False, **kw}
    return write_shards([str(f) for f in files], str(tiny_data.tokenizer), out, **kw)


def test_null_texts_are_dropped_and_counted_and_other_non_strings_refused(tmp_path, tiny_data, capsys):
    path = tmp_path / "a.jsonl"
    records = [{"text": "one document"}, {"text": None}, {"text": "another one"}, {"text": None}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    docs = list(read_documents([str(path)], stats=(stats := documents.DecodeStats())))
    assert [d.text for d in docs] == ["one document", "another one"] and stats.null_texts == 2
    assert main(["data", "shard", "--input", str(path), "--tokenizer", str(tiny_data.tokenizer), "--out",
                 str(tmp_path / "s"), "--workers", "1", "--valid-every", "0"]) == 0  # fmt: skip
    assert "note: 2 records whose text is null were dropped" in capsys.readouterr().err
    for value, kind in ((12, "int"), ({"x": 1}, "dict"), (["a"], "list"), (True, "bool")):
        path.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": value}) + "\n")
        with pytest.raises(DataError, match=rf"^{path}:2: the field 'text' holds a {kind}, not a string"):
            list(read_documents([str(path)]))


def write_arrow(path: Path, table: pa.Table) -> Path:
    with pa.ipc.new_stream(path, table.schema) as writer:
        writer.write_table(table)
    return path


def damaged_inputs(tmp_path: Path) -> dict[str, Path]:
    """Inputs damaged in the ways a download or a disk damages them, one of each kind."""
    tmp_path.mkdir(exist_ok=True)
    bad_utf8 = pa.array([b"ok", b"\xff\xfe broken"], pa.binary()).cast(pa.string(), safe=False)
    pq.write_table(pa.table({"text": bad_utf8}), tmp_path / "utf8.parquet")
    arrow = write_arrow(tmp_path / "good.arrow", pa.table({"text": [f"document {i} " * 20 for i in range(50)]}))
    data = bytearray(arrow.read_bytes())
    garbled = tmp_path / "garbled.arrow"
    garbled.write_bytes(bytes(data[:300]) + bytes(b ^ 0x5A for b in data[300:]))
    offsets = tmp_path / "offsets.arrow"  # the first value offsets of the body, overwritten
    body = data.index(b"document 0")
    offsets.write_bytes(bytes(data[: body - 256]) + b"\xff" * 200 + bytes(data[body - 56 :]))
    nested = tmp_path / "nested.jsonl"
    nested.write_text('{"text": "fine"}\n' + "[" * 200_000 + "]" * 200_000 + "\n")
    zst = tmp_path / "random.jsonl.zst"
    zst.write_bytes(os.urandom(4096))
    gz = tmp_path / "truncated.jsonl.gz"
    gz.write_bytes(
        gzip.compress(("".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5000))).encode())[:2000]
    )
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": 5}]}))
    (saved / "dataset_info.json").write_text("{}")
    return {"utf8": tmp_path / "utf8.parquet", "garbled": garbled, "offsets": offsets, "nested": nested,
            "zst": zst, "gz": gz, "saved": saved}  # fmt: skip


@pytest.mark.parametrize("damage", ["utf8", "garbled", "offsets", "nested", "zst", "gz", "saved"])
def test_damaged_inputs_are_refused_in_one_line_naming_the_file(tmp_path, tiny_data, damage, capsys):
    path = damaged_inputs(tmp_path / "in")[damage]
    code = main(["data", "shard", "--input", str(path), "--tokenizer", str(tiny_data.tokenizer), "--out",
                 str(tmp_path / "out"), "--workers", "1"])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err[-3:]
    assert err[0].startswith("megatransformer data shard: error: ") and str(path) in err[0]
    assert not (tmp_path / "out" / MANIFEST).exists()


def test_a_dictionary_encoded_parquet_column_is_text(tmp_path):
    texts = ["alpha beta", "gamma", "alpha beta", None, "delta"]
    table = pa.table({"text": pa.array(texts).dictionary_encode()})
    assert pa.types.is_dictionary(table.schema.field("text").type)
    pq.write_table(table, tmp_path / "d.parquet")
    arrow = write_arrow(tmp_path / "d.arrow", table)
    for path in (tmp_path / "d.parquet", arrow):
        assert [d.text for d in read_documents([str(path)])] == ["alpha beta", "gamma", "alpha beta", "delta"]
    pq.write_table(pa.table({"text": pa.array([1, 2]).dictionary_encode()}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match="column 'text' holds (dictionary<values=)?int64.*, not text"):
        list(read_documents([str(tmp_path / "n.parquet")]))


def test_a_pathological_document_is_tokenized_in_pieces_and_one_past_the_cap_skipped(
    tmp_path, tiny_data, monkeypatch, capsys
):
    from data_pipeline import shard

    words = tiny_data.corpus.read_text().split()
    long_text = " ".join(words[:3000])
    path = tmp_path / "a.jsonl"
    texts = ["a short one", long_text, "x" * 5000, "the last one"]
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    shard_inputs([path], tiny_data, tmp_path / "whole")
    whole = shard_documents(tmp_path / "whole")
    monkeypatch.setattr(shard, "PIECE_CHARS", 500)  # the tokenizer sees at most ~500 characters at a time
    seen: list[int] = []

    class Spy:
        def __init__(self, tokenizer):
            self.tokenizer = tokenizer

        def encode_batch_fast(self, texts, **kw):
            seen.extend(map(len, texts))
            return self.tokenizer.encode_batch_fast(texts, **kw)

    load = shard.load_tokenizer
    monkeypatch.setattr(
        shard, "load_tokenizer", lambda p: dataclasses.replace(load(p), tokenizer=Spy(load(p).tokenizer))
    )
    shard_inputs([path], tiny_data, tmp_path / "pieces")
    assert shard_documents(tmp_path / "pieces") == whole
    assert max(seen) <= 500  # (the word of 5,000 characters: cut where it must be)
    monkeypatch.setattr(documents, "MAX_DOCUMENT_CHARS", 4000)
    assert main(["data", "shard", "--input", str(path), "--tokenizer", str(tiny_data.tokenizer), "--out",
                 str(tmp_path / "capped"), "--workers", "1", "--valid-every", "0"]) == 0  # fmt: skip
    err = capsys.readouterr().err
    assert "2 documents longer than 4,000 characters were skipped (the first: " in err and f"{path}:2" in err
    assert [len(ids) for ids, _ in shard_documents(tmp_path / "capped")] == [len(whole[0][0]), len(whole[3][0])]


# ------------------------------------------------------------------------------------ containment


def test_a_saved_dataset_names_only_its_own_files(tmp_path):
    outside = write_arrow(tmp_path / "x.arrow", pa.table({"text": ["secret"]}))
    for name in ("../x.arrow", str(outside)):
        saved = tmp_path / "saved"
        shutil.rmtree(saved, ignore_errors=True)
        saved.mkdir()
        (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": name}]}))
        (saved / "dataset_info.json").write_text("{}")
        with pytest.raises(DataError, match=rf"state.json names {name!r}, which is not a file inside {saved}"):
            documents.input_files([str(saved)])
    saved.joinpath("data.arrow").symlink_to(outside)
    (saved / "state.json").write_text(json.dumps({"_data_files": [{"filename": "data.arrow"}]}))
    with pytest.raises(DataError, match="'data.arrow', which is not a file inside"):
        documents.input_files([str(saved)])


def test_a_shard_or_part_directory_linked_elsewhere_is_refused(tiny_data, tmp_path, tok):
    copy = tmp_path / "shards"
    shutil.copytree(tiny_data.shards, copy)
    info = Manifest.load(copy).splits["train"][0]
    elsewhere = tmp_path / "elsewhere.tar"
    (copy / info.file).rename(elsewhere)
    (copy / info.file).symlink_to(elsewhere)
    with pytest.raises(DataError, match=rf"{copy}: its shard {info.file} is a link to .*elsewhere.tar"):
        build_loader(loader_settings(copy, seed=0), "train", 2, 0, 1, tok)


# ------------------------------------------------------------------------------------ parts


@pytest.fixture()
def parts(tiny_data, tmp_path):
    texts = [d.text for d in read_documents([str(tiny_data.corpus)])][:60]
    files = []
    for i in range(2):
        files.append(tmp_path / f"{i}.txt")
        files[-1].write_text("\n\n".join(texts[i::2]))
    out = tmp_path / "parts"
    for k in (1, 2):
        shard_inputs(files, tiny_data, out, part=(k, 2), shard_mb=0.01)
    return out


def test_training_on_parts_not_yet_merged_names_the_merge(parts, tok):
    with pytest.raises(DataError, match=rf"{parts} has no manifest.json yet, only parts .* merge --out {parts}`"):
        build_loader(loader_settings(parts, seed=0), "train", 2, 0, 1, tok)


@pytest.mark.parametrize("part", [[0, 0], [-1, -1], [3, 2], [1, "2"], "1/2"])
def test_merge_refuses_a_part_record_that_is_not_a_part(parts, part):
    record = parts / "part-00001-of-00002" / PART_RECORD
    record.write_text(json.dumps({**json.loads(record.read_text()), "part": part}))
    with pytest.raises(DataError, match=rf"{record} is not a valid part record \(part"):
        merge_parts(parts)


def test_merge_refuses_parts_whose_directories_are_swapped(parts):
    one, two = parts / "part-00001-of-00002", parts / "part-00002-of-00002"
    one.rename(parts / "swap")
    two.rename(one)
    (parts / "swap").rename(two)
    with pytest.raises(DataError, match=rf"{one} holds the record of part 2/2; .*re-run"):
        merge_parts(parts)


def test_merge_refuses_a_part_directory_linked_elsewhere(parts, tmp_path):
    one = parts / "part-00001-of-00002"
    one.rename(tmp_path / "elsewhere")
    one.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(DataError, match=rf"{one} is a link .*elsewhere"):
        merge_parts(parts)
