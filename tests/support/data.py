"""Data-loader configs of tiny_data, and batches from the data loaders, compared tensor by tensor."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from data_pipeline.loader import LoaderSettings
from data_pipeline.loader.blocks import ShardOpener
from data_pipeline.loader.reader import DocumentReader, Position
from data_pipeline.loader.sources import resolve_datasets
from data_pipeline.remote import Retry
from data_pipeline.settings import DataSettings
from megatransformer.config import RunConfig, validate

INSTRUCTION_VALID_EVERY = 5  # the tiny_instructions fixture's validation split: every 5th example


def take(loader, n: int) -> list[dict[str, torch.Tensor]]:
    """The loader's first ``n`` batches (fewer if it ends before)."""
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == n:
            break
    return batches


def assert_same_batches(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


def loader_config(
    tiny_data, objective="autoregressive", arch="decoder", seq_len=64, *, seed: int, max_seq_len: int = 256, **data
) -> RunConfig:
    """A run config of a small model (vocabulary 512: tiny_data's tokenizer) that reads tiny_data's shards
    (``train=``: others) with ``data`` settings."""
    data = {"train": str(tiny_data.shards), "tokenizer": str(tiny_data.tokenizer), "seq_len": seq_len, **data}
    raw = {
        "model": {"arch": arch, "vocab_size": 512, "max_seq_len": max_seq_len, "d_model": 32, "n_heads": 2},
        "data": data,
        "objective": objective,
        "seed": seed,
    }
    return validate(raw)


def loader_settings(
    train: str | Path, objective="autoregressive", arch="decoder", *, seed: int, **kw
) -> LoaderSettings:
    """data_pipeline's loader settings for ``train`` (a shard directory or URL) at 32 tokens, vocabulary 512;
    ``kw``: fields of DataSettings or of LoaderSettings."""
    data = {key: kw.pop(key) for key in list(kw) if key in DataSettings.__dataclass_fields__}
    return LoaderSettings(
        DataSettings(train=str(train), seq_len=32, **data), objective, arch, vocab_size=512, seed=seed, **kw
    )


def global_rows(loaders: Iterable, per_rank: int, field: str | None = None) -> list:
    """The first ``per_rank`` rows of each rank's loader (rank r's: the r-th of ``loaders``, read in turn), put
    in global row order (rank r's local row i is global row r + dp * i): each row a dict of its tensors, or
    with ``field``, that tensor alone."""
    per_rank_rows = []
    for loader in loaders:
        local = []
        for batch in loader:
            rows = len(next(iter(batch.values())))
            local += [batch[field][j] if field else {k: v[j] for k, v in batch.items()} for j in range(rows)]
            if len(local) == per_rank:
                break
        per_rank_rows.append(local)
    dp = len(per_rank_rows)
    return [per_rank_rows[g % dp][g // dp] for g in range(per_rank * dp)]


def reformat_shards(
    src: Path, out: Path, version: int, block_bytes: int = 4096, compression: str | None = None
) -> Path:
    """``src``'s shard directory rewritten in shard format ``version``: the same documents in the same shards
    (format 2: in blocks of ``block_bytes``, compressed with ``compression``), so that a loader must read the
    same documents from both."""
    import dataclasses

    import numpy as np
    import webdataset as wds

    from data_pipeline.shard import Block, Manifest, ShardWriter

    manifest = Manifest.load(src)
    out.mkdir()
    splits = {}
    for split, shards in manifest.splits.items():
        writer = ShardWriter(out, split, 1 << 40, block_bytes, version, compression)
        for info in shards:
            blocks = [Block.from_sample(s) for s in wds.WebDataset(str(src / info.file), shardshuffle=False)]
            lengths = np.concatenate([np.diff(b.offsets) for b in blocks])
            prompts = None if blocks[0].prompt_lens is None else np.concatenate([b.prompt_lens for b in blocks])
            ids = np.concatenate([b.ids for b in blocks])
            writer.write(ids, lengths, np.arange(len(lengths)), prompts)
            writer.close()  # one shard for each of src's
        splits[split] = writer.shards
    dataclasses.replace(manifest, splits=splits, version=version, compression=compression).save(out)
    return out


def shard_documents(directory: str | Path, split: str = "train") -> list[tuple[list[int], int]]:
    """(token ids, prompt length: 0 for text) of every document of a shard directory's split, in manifest order
    (read by the loader's document reader, unshuffled)."""
    (shard_set,) = resolve_datasets(str(directory), split, Retry())
    reader = DocumentReader(shard_set, 0, 0, 1, False, 1, ShardOpener("error", Retry()), epochs=1)
    return [(ids.tolist(), prompt_len) for ids, prompt_len, _ in reader.documents(Position())]
