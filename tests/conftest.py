"""Session fixtures (tiny data, training runs several tests read), the tiers (every test under ``e2e/`` is slow) and
how pytest-xdist's workers share the tests out."""

from __future__ import annotations

import os
import sys

# One intra-op thread in this process and in every process a test starts, unless the environment chooses: the
# tests' ranks and pytest-xdist's workers share the machine's cores, and the thread picker's "busy machine"
# line would otherwise come and go with the load (tests/unit/test_threads.py tests the picker itself).
# Set before torch is first imported: OpenMP reads it once, as it loads.
os.environ.setdefault("OMP_NUM_THREADS", "1")
if "torch" in sys.modules:  # (a plugin loaded it first)
    sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import pytest  # noqa: E402
from support.data import INSTRUCTION_VALID_EVERY  # noqa: E402
from support.runs import SharedRuns  # noqa: E402

TESTS = Path(__file__).parent
E2E = TESTS / "e2e"
# the most workers ``-n auto`` starts: an end-to-end test runs up to four ranks of its own
MOST_WORKERS = 4


@pytest.hookimpl(tryfirst=True)  # (before pytest-xdist reads the groups)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tier is the folder: tests under e2e/ (subprocesses, ranks, DeepSpeed, torch.compile) are marked slow.

    Under pytest-xdist (``--dist loadgroup``, as the README's test command runs it) a file's tests run in one
    worker, in order, so that its module fixtures are made once; the files that submit jobs to the local Slurm cluster
    share one worker, so that their jobs never wait for each other's nodes."""
    slurm_files = {item.path for item in items if item.get_closest_marker("slurm")}
    for item in items:
        if E2E in item.path.parents:
            item.add_marker(pytest.mark.slow)
        group = "slurm" if item.path in slurm_files else item.path.relative_to(TESTS).as_posix()
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(optionalhook=True)  # (pytest-xdist's hook: pytest without it, as on the GPU image, runs too)
def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: a worker per core and one more, at most MOST_WORKERS (each runs up to four ranks): a test's ranks
    leave cores idle while they start, wait for each other and end, and the Slurm tests wait on the scheduler; the
    one more keeps the cores busy then (BENCHMARKS.md, section 5ah)."""
    return min(MOST_WORKERS, len(os.sched_getaffinity(0)) + 1)


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
