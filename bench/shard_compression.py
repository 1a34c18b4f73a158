"""Shard compression: bytes per token of format-2 blocks plain and zstd-compressed at several levels, what
compressing costs the writer and what decompressing costs the loader, per core.

    python bench/shard_compression.py [--input FILES...] [--vocab-sizes 2048,32768] [--doc-tokens 100,1500]
                                      [--levels 1,3,9,19]

Without ``--input`` the corpus is the standard library's docstrings (``megatransformer data demo-corpus``, all
of them: ~1.4 MB). A tokenizer of each ``--vocab-sizes`` is trained on the corpus, then for each of these sets
of documents:

- ``corpus``: the corpus's own documents (blank-line-separated blocks), as ``data shard`` reads them;
- ``cut ~N``: the corpus's words cut into consecutive documents of ~N tokens, each word used once;
- ``random ~N``: bench/data.py's synthetic documents (random runs of the corpus's words, ``--set-tokens``
  tokens): runs that overlap, so zstd finds the same text again and again; they overstate what it saves on
  real text and are measured only next to the others.

the documents are cut into the blocks a ShardWriter writes (~1 MiB of ids each) and measured per block, on
one core: the sample's bytes (ids, offsets, .npy headers) plain and zstd at each level, the ids split into
byte planes (the high bytes, then the low ones) at the writer's level, the same ids stored as uint32 (as a
vocabulary over 65,536 stores them) plain and at the writer's level; compressing in tokens/s (the members
with ``zstandard``, as ``Block.sample`` does) and reading a block back with ``Block.from_sample`` (the loader's
own path: decompress and decode) in tokens/s, plain and compressed. With ``--load-streams``, the ``corpus``
set is also sharded both ways (``--load-shard-mb``) and read by the loader (autoregressive, main process) with
that many streams: rounds of ``--load-batches`` batches, plain and compressed in turn, the median of each and
of the rounds' ratios (a few streams: each reads whole shards, as on a corpus of more shards than streams;
64 streams on a few shards: each reads a part of one, and decompresses the blocks its part touches). For the
writer's tokens/s both ways: ``python bench/data.py --compress none,zstd``. Timings on shared machines are
noisy: compare numbers from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import zstandard

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))

import data as data_bench  # noqa: E402

from data_pipeline.documents import read_documents  # noqa: E402
from data_pipeline.shard import BLOCK_BYTES, ZSTD_LEVEL, Block, encode, token_dtype  # noqa: E402
from data_pipeline.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402


def document_sets(corpus: list[str], tokenizer: Path, doc_tokens: list[int], set_tokens: int, work: Path):
    """(name, texts) of each set of documents measured."""
    texts = [doc.text for doc in read_documents(corpus)]
    yield "corpus", texts
    words = " ".join(texts).split()
    per_word = len(load_tokenizer(tokenizer).encode(" ".join(words[:20_000]))) / min(len(words), 20_000)
    for n in doc_tokens:
        run = max(1, round(n / per_word))
        yield f"cut ~{n}", [" ".join(words[i : i + run]) for i in range(0, len(words), run)]
    for n in doc_tokens:
        path = data_bench.synthetic_documents(corpus, tokenizer, n, set_tokens, work / f"random-{n}.jsonl")
        yield f"random ~{n}", [json.loads(line)["text"] for line in path.read_text().splitlines()]


def blocks_of(texts: list[str], tokenizer: Path) -> list[Block]:
    """The documents in blocks of whole documents that reach BLOCK_BYTES of ids, as ShardWriter cuts them."""
    tok = load_tokenizer(tokenizer)
    tokenized = encode(tok, texts, token_dtype(tok.vocab_size), paired=False)
    ends = np.cumsum(tokenized.lengths)
    per_block = BLOCK_BYTES // tokenized.ids.itemsize
    blocks, first = [], 0
    while first < len(ends):
        start = ends[first - 1] if first else 0
        stop = min(len(ends), int(np.searchsorted(ends, start + per_block)) + 1)
        offsets = np.concatenate([[0], ends[first:stop] - start])
        blocks.append(Block(tokenized.ids[start : ends[stop - 1]], offsets))
        first = stop
    return blocks


def timed(fn, repeat: int) -> float:
    """The fastest of ``repeat`` runs of ``fn``, in seconds (the least disturbed by other jobs)."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def measure(blocks: list[Block], levels: list[int], repeat: int) -> dict:
    tokens = sum(len(b.ids) for b in blocks)
    plain = [b.sample("k") for b in blocks]
    members = [{name: data for name, data in s.items() if name != "__key__"} for s in plain]
    row: dict = {"tokens": tokens, "documents": sum(len(b) for b in blocks), "blocks": len(blocks)}
    row["plain"] = sum(len(d) for m in members for d in m.values()) / tokens
    row["read_plain_tokens_per_s"] = tokens / timed(lambda: [Block.from_sample(s) for s in plain], repeat)
    for level in levels:
        compressor = zstandard.ZstdCompressor(level=level)
        packed = []

        def compress() -> None:
            packed[:] = [{f"{n}.zst": compressor.compress(d) for n, d in m.items()} for m in members]

        seconds = timed(compress, 1 if level > 9 else repeat)
        row[f"zstd {level}"] = sum(len(d) for m in packed for d in m.values()) / tokens
        row[f"zstd {level} compress_tokens_per_s"] = tokens / seconds
        row[f"zstd {level} read_tokens_per_s"] = tokens / timed(lambda: [Block.from_sample(s) for s in packed], repeat)
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    planes = sum(
        len(compressor.compress(b.ids.view(np.uint8).reshape(-1, b.ids.itemsize).T.tobytes()))
        + len(compressor.compress(m["offsets.npy"]))
        for b, m in zip(blocks, members)
    )
    row[f"planes zstd {ZSTD_LEVEL}"] = planes / tokens
    wide = [Block(b.ids.astype(np.uint32), b.offsets).sample("k") for b in blocks]  # as a >65,536 vocabulary's
    row["uint32"] = sum(len(d) for s in wide for n, d in s.items() if n != "__key__") / tokens
    packed = [Block(b.ids.astype(np.uint32), b.offsets).sample("k", compression="zstd") for b in blocks]
    row[f"uint32 zstd {ZSTD_LEVEL}"] = sum(len(d) for s in packed for n, d in s.items() if n != "__key__") / tokens
    return row


def bench_loader(
    texts: list[str], tokenizer: Path, work: Path, streams: int, shard_mb: float, rounds: int, batches: int
) -> dict:
    """The loader's tokens/s on ``texts`` sharded plain and with zstd, in alternating rounds."""
    from data_pipeline.loader import LoaderSettings, build_loader
    from data_pipeline.settings import DataSettings
    from data_pipeline.shard import write_shards

    source = work / "load.jsonl"
    source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = load_tokenizer(tokenizer)
    loaders, shards = {}, {}
    for compression in (None, "zstd"):
        out = work / f"load-{compression}"
        kw = {"shard_mb": shard_mb, "valid_every": 0, "workers": 1, "progress": False, "overwrite": True}
        shards[compression] = len(
            write_shards([str(source)], str(tokenizer), out, compression=compression, **kw).splits["train"]
        )
        data = DataSettings(train=str(out), seq_len=1024, streams=streams)
        loader = iter(
            build_loader(LoaderSettings(data, "autoregressive", "decoder", tok.vocab_size), "train", 8, 0, 1, tok)
        )
        for _ in range(batches):  # warm-up: every stream's first shard
            next(loader)
        loaders[compression] = loader
    speeds: dict = {None: [], "zstd": []}
    for r in range(rounds):
        for compression in (None, "zstd") if r % 2 == 0 else ("zstd", None):
            started, tokens = time.perf_counter(), 0
            for _ in range(batches):
                tokens += next(loaders[compression])["input_ids"].numel()
            speeds[compression].append(tokens / (time.perf_counter() - started))
    ratios = [z / p for p, z in zip(speeds[None], speeds["zstd"])]
    return {
        "streams": streams,
        "shards": shards[None],
        "zstd_shards": shards["zstd"],
        "load_plain_tokens_per_s": statistics.median(speeds[None]),
        "load_zstd_tokens_per_s": statistics.median(speeds["zstd"]),
        "load_ratio": statistics.median(ratios),
        "load_ratio_range": (min(ratios), max(ratios)),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="*", help="text files as the corpus (default: the demo corpus)")
    p.add_argument("--vocab-sizes", default="2048,32768")
    p.add_argument("--doc-tokens", default="100,1500", help="document lengths of the cut and random sets")
    p.add_argument("--set-tokens", type=int, default=600_000, help="tokens of each random set")
    p.add_argument("--levels", default="1,3,9,19", help="zstd levels")
    p.add_argument("--repeat", type=int, default=3, help="timings: the fastest of this many runs")
    p.add_argument("--load-streams", default="", help="also the loader with these data.streams, e.g. 2,64")
    p.add_argument("--load-shard-mb", type=float, default=0.125, help="shard size of the loader's shards")
    p.add_argument("--load-rounds", type=int, default=10, help="rounds of the loader, plain and zstd in turn")
    p.add_argument("--load-batches", type=int, default=40, help="batches (8 x 1024 tokens) a round")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    levels = [int(x) for x in args.levels.split(",")]
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        corpus = data_bench.prepare_corpus(argparse.Namespace(input=args.input, repeat=1), work)
        for vocab in map(int, args.vocab_sizes.split(",")):
            tokenizer = work / f"tokenizer-{vocab}.json"
            train_tokenizer(corpus[:1], vocab, tokenizer)
            actual = load_tokenizer(tokenizer).vocab_size
            doc_tokens = [int(n) for n in args.doc_tokens.split(",")]
            for name, texts in document_sets(corpus, tokenizer, doc_tokens, args.set_tokens, work):
                row = measure(blocks_of(texts, tokenizer), levels, args.repeat)
                rows.append({"vocab": actual, "set": name, **row})
                print(table_line(rows[-1], levels), flush=True)
                for streams in [int(n) for n in args.load_streams.split(",") if n] if name == "corpus" else []:
                    load = bench_loader(
                        texts, tokenizer, work, streams, args.load_shard_mb, args.load_rounds, args.load_batches
                    )
                    rows.append({"vocab": actual, "set": name, **load})
                    print(load_line(rows[-1]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


def table_line(row: dict, levels: list[int]) -> str:
    """vocab, set, tokens; bytes per token plain, at each level and as byte planes; compress and read tokens/s
    (millions, one core)."""
    sizes = " ".join(f"{row[f'zstd {level}']:.2f}" for level in levels)
    compress = " ".join(f"{row[f'zstd {level} compress_tokens_per_s'] / 1e6:,.1f}" for level in levels)
    read = " ".join(f"{row[f'zstd {level} read_tokens_per_s'] / 1e6:,.0f}" for level in levels)
    planes = next(v for k, v in row.items() if k.startswith("planes"))
    wide = next(v for k, v in row.items() if k.startswith("uint32 zstd"))
    return (
        f"vocab {row['vocab']:>6,} {row['set']:12s} {row['tokens']:>9,} tokens in {row['blocks']:>2} blocks: "
        f"bytes/token plain {row['plain']:.2f}, zstd {sizes} (planes {planes:.2f}; uint32 {row['uint32']:.2f}, "
        f"zstd {wide:.2f}); "
        f"compress {compress} M tokens/s; read plain {row['read_plain_tokens_per_s'] / 1e6:,.0f}, zstd {read} "
        "M tokens/s"
    )


def load_line(row: dict) -> str:
    low, high = row["load_ratio_range"]
    return (
        f"vocab {row['vocab']:>6,} {row['set']:12s} loader, {row['streams']} streams, {row['shards']} / "
        f"{row['zstd_shards']} shards: plain {row['load_plain_tokens_per_s'] / 1e6:.2f} M, zstd "
        f"{row['load_zstd_tokens_per_s'] / 1e6:.2f} M tokens/s (medians); zstd / plain {row['load_ratio']:.3f} "
        f"(rounds {low:.2f}-{high:.2f})"
    )


if __name__ == "__main__":
    sys.exit(main())
