"""Session fixtures (tiny data, training runs several tests read) and the tiers: every test under ``e2e/`` is slow."""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import pytest
from support.data import INSTRUCTION_VALID_EVERY
from support.runs import SharedRuns

E2E = Path(__file__).parent / "e2e"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tier is the folder: tests under e2e/ (subprocesses, ranks, DeepSpeed, torch.compile) are marked slow."""
    for item in items:
        if E2E in item.path.parents:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory: pytest.TempPathFactory) -> SharedRuns:
    """Training runs made once per session, for the tests that read the same one."""
    return SharedRuns(tmp_path_factory.mktemp("shared_runs"))


# ============================================================================ data_pipeline fixtures
# tiny_data: demo corpus (stdlib docstrings, ~0.3 MB) -> byte-level BPE (vocab 512) -> WebDataset shards
# (train + valid, many small shards so several ranks x workers can split them), built once per session.

TINY_VOCAB = 512
TINY_CORPUS_BYTES = 300_000
TINY_SHARD_MB = 0.012  # ~25 train shards
TINY_BLOCK_MB = 0.004  # a few documents a block, a few blocks a shard
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
    write_shards(
        [str(corpus)],
        str(tokenizer),
        shards,
        shard_mb=TINY_SHARD_MB,
        valid_every=TINY_VALID_EVERY,
        workers=1,
        progress=False,
        block_mb=TINY_BLOCK_MB,
    )
    return TinyData(tokenizer, shards)


@pytest.fixture(scope="session")
def tok(tiny_data: TinyData):
    """tiny_data's tokenizer, loaded."""
    from data_pipeline.tokenizer import load_tokenizer

    return load_tokenizer(tiny_data.tokenizer)


class TinyInstructions(NamedTuple):
    jsonl: Path  # {"prompt", "completion"} records
    shards: Path  # shard directory (kind prompt_completion), train + valid splits

    def examples(self) -> list[tuple[str, str]]:
        import json

        return [(r["prompt"], r["completion"]) for r in map(json.loads, self.jsonl.read_text().splitlines())]


@pytest.fixture(scope="session")
def tiny_instructions(tiny_data: TinyData) -> TinyInstructions:
    """Instruction examples made from the corpus documents: the prompt asks to continue a document's first
    words, the completion is the rest (at most 90 + 110 characters); sharded with tiny_data's
    tokenizer."""
    import json

    from data_pipeline.documents import read_documents
    from data_pipeline.shard import write_shards

    root = tiny_data.shards.parent / "instructions"
    root.mkdir()
    jsonl = root / "examples.jsonl"
    with jsonl.open("w") as f:
        for doc in list(read_documents([str(tiny_data.corpus)]))[:400]:
            words = doc.text.split()
            cut = max(1, min(len(words) // 3, 12))
            completion = (" " + " ".join(words[cut:]))[:110] if len(words) > cut else ""
            record = {"prompt": "Continue: " + " ".join(words[:cut])[:80] + "\n", "completion": completion}
            f.write(json.dumps(record) + "\n")
    shards = root / "shards"
    write_shards(
        [str(jsonl)],
        str(tiny_data.tokenizer),
        shards,
        shard_mb=0.01,
        valid_every=INSTRUCTION_VALID_EVERY,
        workers=1,
        progress=False,
        prompt_field="prompt",
        text_field="completion",
        block_mb=0.002,
    )
    return TinyInstructions(jsonl, shards)


# ======================================================================== end of data_pipeline fixtures
