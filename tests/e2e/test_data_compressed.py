"""`megatransformer data shard --compress zstd` as a user runs it (two tokenizer processes), then the loader's
first batches through `data inspect`: the documents of the uncompressed shards, in fewer bytes."""

from __future__ import annotations

import json

from support.data import shard_documents
from support.runs import cli

from data_pipeline.shard import Manifest


def test_shard_compressed_then_load(tiny_data, tmp_path):
    out = tmp_path / "zstd"
    shard = cli(
        *("data", "shard", "--input", tiny_data.corpus, "--tokenizer", tiny_data.tokenizer, "--out", out),
        *("--shard-mb", "0.05", "--valid-every", "10", "--workers", "2", "--compress", "zstd"),
    )
    manifest = Manifest.load(out)
    assert manifest.compression == "zstd"
    assert manifest.bytes_per_token() < 0.8 * Manifest.load(tiny_data.shards).bytes_per_token()
    assert f"{manifest.bytes_per_token():.2f} bytes per token on disk" in shard.stdout
    assert "uint16 ids, zstd-compressed)" in shard.stdout
    for split in ("train", "valid"):
        assert shard_documents(out, split) == shard_documents(tiny_data.shards, split)
    config = tmp_path / "run.yaml"
    config.write_text(
        json.dumps(
            {
                "model": {"arch": "decoder", "vocab_size": 512, "d_model": 32, "n_heads": 2},
                "data": {"train": str(out), "tokenizer": str(tiny_data.tokenizer), "seq_len": 64},
                "objective": "autoregressive",
                "train": {"micro_batch_size": 4},
            }
        )
    )
    inspect = cli("data", "inspect", "--config", config, "--batches", "2")
    assert (
        f"train data {out}: format 2, zstd, {manifest.bytes_per_token('train'):.2f} bytes per token" in inspect.stdout
    )
    assert "documents_per_sequence" in inspect.stdout
    refused = cli(
        *("data", "shard", "--input", tiny_data.corpus, "--tokenizer", tiny_data.tokenizer),
        "--out",
        tmp_path / "x",
        "--compress",
        "lz4",
        check=False,
    )
    assert refused.returncode == 2 and "invalid choice: 'lz4'" in refused.stderr
