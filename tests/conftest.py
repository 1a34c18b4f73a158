"""Shared pytest fixtures. Each area keeps its fixtures in its own clearly marked block."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest

# ============================================================================ data_pipeline fixtures (issue #3)
# tiny_data: demo corpus (stdlib docstrings, ~0.3 MB) -> byte-level BPE (vocab 512) -> WebDataset shards
# (train + valid, many small shards so several ranks x workers can split them), built once per session.

TINY_VOCAB = 512
TINY_CORPUS_BYTES = 300_000
TINY_SHARD_MB = 0.03  # ~25 train shards
TINY_VALID_EVERY = 10


class TinyData(NamedTuple):
    tokenizer: Path  # tokenizer.json
    shards: Path  # shard directory with manifest.json (train + valid splits)

    @property
    def corpus(self) -> Path:
        """The text the shards were made from (blank-line-separated documents)."""
        return self.shards.parent / "corpus.txt"


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory: pytest.TempPathFactory) -> TinyData:
    from data_pipeline.corpus import write_demo_corpus
    from data_pipeline.shard import write_shards
    from data_pipeline.tokenizer import train_tokenizer

    root = tmp_path_factory.mktemp("tiny_data")
    corpus = write_demo_corpus(root / "corpus.txt", max_bytes=TINY_CORPUS_BYTES)
    tokenizer = root / "tokenizer.json"
    train_tokenizer([str(corpus)], TINY_VOCAB, tokenizer)
    shards = root / "shards"
    write_shards([str(corpus)], str(tokenizer), shards, shard_mb=TINY_SHARD_MB, valid_every=TINY_VALID_EVERY,
                 workers=1, progress=False)
    return TinyData(tokenizer, shards)

# ======================================================================== end of data_pipeline fixtures
