"""Small and ordinary inputs: a default validation split that small files still get, validation splits smaller
than one batch evaluated as they are (with a warning), input directories for the data commands."""

from __future__ import annotations

import json

import pytest
import zstandard

from data_pipeline import DataError
from data_pipeline.documents import input_files, read_documents
from data_pipeline.shard import Manifest, held_out, write_shards
from data_pipeline.tokenizer import load_tokenizer
from megatransformer.cli import main
from megatransformer.config import validate
from megatransformer.training.data import build_run_loader, small_validation_warning


def examples_file(path, tiny_data, n: int):
    """``n`` instruction examples made from the demo corpus."""
    docs = [d.text.split() for d in read_documents([str(tiny_data.corpus)])][:n]
    assert len(docs) == n
    path.write_text(
        "".join(json.dumps({"prompt": " ".join(w[:4]) + "\n", "completion": " ".join(w[4:16])}) + "\n" for w in docs)
    )
    return path


def loader_cfg(shards, tiny_data, seq_len=64):
    return validate(
        {
            "model": {"arch": "decoder", "vocab_size": 512, "max_seq_len": 256, "d_model": 32, "n_heads": 2},
            "data": {"train": str(shards), "tokenizer": str(tiny_data.tokenizer), "seq_len": seq_len},
            "objective": "prefix_lm",
        }
    )


def test_default_split_holds_out_a_tenth_of_small_inputs_and_a_hundredth_after():
    assert sum(held_out(n, None) for n in range(400)) == 40
    assert sum(held_out(n, None) for n in range(11_000)) == 100 + 100
    assert [n for n in range(40) if held_out(n, 20)] == [19, 39]  # an explicit --valid-every as before
    assert not any(held_out(n, 0) for n in range(1000))


def test_a_400_example_file_gets_a_validation_split_of_several_batches(tmp_path, tiny_data):
    sft = examples_file(tmp_path / "sft.jsonl", tiny_data, 400)
    manifest = write_shards(
        [str(sft)],
        str(tiny_data.tokenizer),
        tmp_path / "sft",
        workers=1,
        progress=False,
        prompt_field="prompt",
        text_field="completion",
    )
    assert sum(s.documents for s in manifest.splits["valid"]) == 40
    tok = load_tokenizer(tiny_data.tokenizer)
    loader = build_run_loader(loader_cfg(tmp_path / "sft", tiny_data), "valid", 4, 0, 1, tok)
    assert small_validation_warning(loader, 4) is None


def test_validation_smaller_than_a_batch_is_one_smaller_batch_with_a_warning(tiny_data):
    tok = load_tokenizer(tiny_data.tokenizer)
    cfg = loader_cfg(tiny_data.shards, tiny_data, seq_len=256)
    whole = list(build_run_loader(cfg, "valid", 10_000, 0, 1, tok))
    assert len(whole) == 1 and 0 < len(whole[0]["input_ids"]) < 10_000
    rows = len(whole[0]["input_ids"])
    warning = small_validation_warning(build_run_loader(cfg, "valid", 10_000, 0, 1, tok), 10_000)
    assert warning.startswith(f"warning: the validation split holds {rows} sequences, less than one batch of 10000")
    batches = list(build_run_loader(cfg, "valid", 4, 0, 1, tok))  # every row counted: a last, smaller batch
    assert [len(b["input_ids"]) for b in batches] == [4] * (rows // 4) + ([rows % 4] if rows % 4 else [])


def test_an_input_directory_stands_for_its_text_and_jsonl_files(tmp_path, tiny_data, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    docs = [d.text for d in read_documents([str(tiny_data.corpus)])][:300]
    (corpus / "a.txt").write_text("\n\n".join(docs[:200]))
    records = "".join(json.dumps({"text": d}) + "\n" for d in docs[200:])
    (corpus / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(records.encode()))
    (corpus / "notes.md").write_text("not an input")
    assert input_files([str(corpus)]) == [str(corpus / "a.txt"), str(corpus / "b.jsonl.zst")]
    assert (
        main(
            [
                "data",
                "shard",
                "--input",
                str(corpus),
                "--tokenizer",
                str(tiny_data.tokenizer),
                "--out",
                str(tmp_path / "shards"),
                "--workers",
                "1",
            ]
        )
        == 0
    )
    said = capsys.readouterr()
    assert "train: 1 shards, 270 documents" in said.out
    bytes_per_token = Manifest.load(tmp_path / "shards").bytes_per_token()
    assert f"{bytes_per_token:.2f} bytes per token on disk ({bytes_per_token / 2:.2f}x the uint16 ids)" in said.out
    assert said.err.startswith(f"note: not reading {corpus / 'notes.md'}: --input reads .txt, .jsonl, .json and .tsv")
    assert said.err.count("\n") == 1
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"input directory .*empty holds no \.txt"):
        input_files([str(tmp_path / "empty")])
