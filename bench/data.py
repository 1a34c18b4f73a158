"""Data-pipeline throughput: shard writing and loading in tokens/s, next to what a training step consumes.

    python bench/data.py [--input FILES...] [--seq-len 1024] [--batches 50] [--http] [--json OUT]
    python bench/data.py --doc-tokens 100,500,1500 --formats 1,2 --train-steps 0
    python bench/data.py --doc-tokens 100,1500 --compress none,zstd --train-steps 0

Without ``--input`` the corpus is the standard library's docstrings (``megatransformer data demo-corpus``),
repeated ``--repeat`` times so that sharding runs long enough to time; with ``--doc-tokens`` it is instead one
set of synthetic documents per length (random runs of the corpus's words, ``--set-tokens`` tokens a set, as
.jsonl). Measures, for each shard format of ``--formats`` and each of ``--compress`` (format 2):

1. shard writing (read + tokenize + write tars) with 1 tokenizer process and with all cores, the shards' bytes
   per token, and (with ``--doc-tokens``) the bare tokenizer (``encode_batch`` on the same texts);
2. the loader for every objective (with ``--doc-tokens``: autoregressive), in the main process
   (num_workers=0) and with all cores as workers; with ``--http`` also the autoregressive loader streaming the
   same shards from an http.server on loopback;
3. with ``--manifest-shards N``, a loader over a manifest of N shards: to its first batch;
4. a training step (forward + backward + AdamW) of a small decoder on this machine's CPU, for scale.

``tokenizers`` runs one thread per process here (TOKENIZERS_PARALLELISM=false), so that one process is one
core. Results print as a table (and JSON with ``--json``); BENCHMARKS.md records them. Timings on shared
machines are noisy: compare numbers from one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

OBJECTIVES = [
    ("autoregressive", "decoder"),
    ("masked_lm", "encoder"),
    ("prefix_lm", "decoder"),
    ("prefix_lm", "encoder_decoder"),
    ("span_corruption", "encoder_decoder"),
]


def prepare_corpus(args: argparse.Namespace, work: Path) -> list[str]:
    if args.input:
        return args.input
    from data_pipeline.corpus import write_demo_corpus

    one = write_demo_corpus(work / "demo.txt", max_bytes=10**9).read_text()
    (work / "corpus.txt").write_text("\n\n".join([one] * args.repeat))
    return [str(work / "corpus.txt")]


def synthetic_documents(corpus: list[str], tokenizer: Path, doc_tokens: int, set_tokens: int, path: Path) -> Path:
    """About ``set_tokens`` tokens of documents of about ``doc_tokens`` tokens each, random runs of the corpus's
    words, as a .jsonl file."""
    import numpy as np

    from data_pipeline.tokenizer import load_tokenizer

    words = " ".join(Path(f).read_text() for f in corpus).split()
    sample = " ".join(words[:20_000])
    per_word = len(load_tokenizer(tokenizer).encode(sample)) / len(sample.split())
    run = max(1, round(doc_tokens / per_word))
    starts = np.random.default_rng(doc_tokens).integers(0, len(words) - run, max(1, set_tokens // doc_tokens))
    with path.open("w") as f:
        for start in starts:
            f.write(json.dumps({"text": " ".join(words[start : start + run])}) + "\n")
    return path


def bench_tokenizer(files: list[str], tokenizer: Path) -> list[dict]:
    """The bare tokenizer: ``encode_batch`` over the documents of ``files`` (.jsonl), one thread."""
    from data_pipeline.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    texts = [json.loads(line)["text"] for f in files for line in Path(f).read_text().splitlines()]
    started = time.perf_counter()
    tokens = sum(len(ids) for ids in tok.encode_batch(texts))
    elapsed = time.perf_counter() - started
    return [{"stage": "tokenize", "workers": 1, "tokens": tokens, "seconds": elapsed, "tokens_per_s": tokens / elapsed}]


def shard_formats(versions: tuple[int, ...], compressions: tuple[str | None, ...]) -> list[tuple[int, str | None]]:
    """The (format version, compression) pairs to write: format 1 is never compressed."""
    return [(v, c) for v in versions for c in compressions if v == 2 or c is None]


def format_directory(work: Path, version: int, compression: str | None, workers: int) -> Path:
    return work / f"format-{version}{'-' + compression if compression else ''}" / f"shards-{workers}"


def bench_sharding(
    files: list[str],
    tokenizer: Path,
    work: Path,
    cores: int,
    versions: tuple[int, ...] = (2,),
    shard_mb: float = 0.25,
    compressions: tuple[str | None, ...] = (None,),
) -> list[dict]:
    """Shard writing into ``format_directory`` with 1 and ``cores`` tokenizer processes, the formats (and
    compressions) side by side for each."""
    import webdataset  # noqa: F401 - imported before the first clock starts

    from data_pipeline.shard import write_shards

    rows = []
    for workers in sorted({1, cores}):
        for version, compression in shard_formats(versions, compressions):
            started = time.perf_counter()
            manifest = write_shards(
                files,
                str(tokenizer),
                format_directory(work, version, compression, workers),
                shard_mb=shard_mb,
                valid_every=100,
                workers=workers,
                progress=False,
                overwrite=True,
                version=version,
                compression=compression,
            )
            elapsed = time.perf_counter() - started
            tokens = sum(manifest.tokens(split) for split in manifest.splits)
            rows.append(
                {
                    "stage": "shard",
                    "workers": workers,
                    "tokens": tokens,
                    "seconds": elapsed,
                    "tokens_per_s": tokens / elapsed,
                    "format": version,
                    "compression": compression,
                    "bytes_per_token": manifest.bytes_per_token("train"),
                }
            )
    return rows


def bench_loading(
    shards: dict[tuple[int, str | None], str],
    tokenizer: Path,
    seq_len: int,
    micro: int,
    batches: int,
    cores: int,
    objectives: list[tuple[str, str]] = OBJECTIVES,
    where: str = "local",
    streams: int | None = None,
) -> list[dict]:
    """The loader on the shard directories of ``shards`` ((format, compression) -> directory), side by side."""
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.config import validate
    from megatransformer.training.data import build_run_loader

    tok = load_tokenizer(tokenizer)
    rows = []
    for objective, arch in objectives:
        for workers in sorted({0, cores}):
            for (version, compression), directory in shards.items():
                cfg = validate(
                    {
                        "model": {"arch": arch, "vocab_size": tok.vocab_size, "max_seq_len": seq_len},
                        "data": {
                            "train": str(directory),
                            "tokenizer": str(tokenizer),
                            "seq_len": seq_len,
                            "num_workers": workers,
                        }
                        | ({"streams": streams} if streams else {}),
                        "objective": objective,
                    }
                )
                loader = build_run_loader(cfg, "train", micro, 0, 1, tok)
                it = iter(loader)
                for _ in range(max(2, workers)):  # warm-up: worker start, first shards
                    next(it)
                started, tokens, real = time.perf_counter(), 0, 0
                for _ in range(batches):
                    batch = next(it)
                    tokens += batch["input_ids"].numel()  # positions (encoder / decoder-only side), padding included
                    real += int((batch["segment_ids"] > 0).sum())
                elapsed = time.perf_counter() - started
                rows.append(
                    {
                        "stage": "load",
                        "objective": f"{objective} ({arch})",
                        "workers": workers,
                        "from": where,
                        "tokens": tokens,
                        "seconds": elapsed,
                        "tokens_per_s": tokens / elapsed,
                        "real_tokens_per_s": real / elapsed,
                        "format": version,
                        "compression": compression,
                    }
                )
    return rows


def bench_many_shards(shards: Path, tokenizer: Path, count: int, seq_len: int, micro: int, work: Path) -> list[dict]:
    """A manifest of ``count`` shards (hard links to the copies of one shard of ``shards``): seconds to build the
    loader (manifest, checks) and to its first batch."""
    import dataclasses
    import shutil

    from data_pipeline.shard import Manifest
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.config import validate
    from megatransformer.training.data import build_run_loader

    manifest = Manifest.load(shards)
    info = manifest.splits["train"][0]
    out = work / f"many-{count}"
    out.mkdir()
    copies = [out / f".copy-{i}" for i in range(-(-count // 60_000))]  # (a file takes ~65,000 hard links)
    for copy in copies:
        shutil.copyfile(shards / info.file, copy)
    for i in range(count):
        os.link(copies[i // 60_000], out / f"train-{i:06d}.tar")
    listed = [dataclasses.replace(info, file=f"train-{i:06d}.tar") for i in range(count)]
    dataclasses.replace(manifest, splits={"train": listed}).save(out)
    tok = load_tokenizer(tokenizer)
    started = time.perf_counter()
    cfg = validate(
        {
            "model": {"arch": "decoder", "vocab_size": tok.vocab_size, "max_seq_len": seq_len},
            "data": {"train": str(out), "tokenizer": str(tokenizer), "seq_len": seq_len, "num_workers": 0},
            "objective": "autoregressive",
        }
    )
    loader = build_run_loader(cfg, "train", micro, 0, 1, tok)
    built = time.perf_counter()
    batch = next(iter(loader))
    first = time.perf_counter()
    return [
        {
            "stage": "manifest",
            "objective": f"{count:,} shards",
            "workers": 0,
            "tokens": batch["input_ids"].numel(),
            "seconds": first - started,
            "tokens_per_s": batch["input_ids"].numel() / (first - started),
            "build_s": built - started,
        }
    ]


@contextlib.contextmanager
def http_server(directory: Path):
    """``directory`` served by ``python -m http.server`` on loopback (its own process, as a server would be);
    yields its URL."""
    import socket
    import subprocess

    with socket.socket() as probe:  # a free port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "--directory", str(directory)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):  # until it accepts connections
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}/"
    finally:
        server.terminate()
        server.wait()


def bench_train_step(seq_len: int, micro: int, steps: int, vocab: int) -> list[dict]:
    """Tokens/s a small Llama-style decoder consumes per training step on this CPU (fp32 and bf16 autocast)."""
    import torch

    from megatransformer.config import ModelConfig
    from megatransformer.model import build_model

    rows = []
    cfg = ModelConfig(
        arch="decoder",
        d_model=512,
        n_layers=8,
        n_heads=8,
        n_kv_heads=4,
        d_ff=1408,
        vocab_size=vocab,
        max_seq_len=seq_len,
    )
    model = build_model(cfg)
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (micro, seq_len))
    for precision in ("fp32", "bf16"):
        times = []
        for step in range(steps + 1):
            started = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
                logits = model(input_ids=ids)
                loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if step:  # the first step warms up
                times.append(time.perf_counter() - started)
        tokens = micro * seq_len * len(times)
        rows.append(
            {
                "stage": "train step",
                "model": f"decoder {params / 1e6:.0f}M params",
                "precision": precision,
                "tokens": tokens,
                "seconds": sum(times),
                "tokens_per_s": tokens / sum(times),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", nargs="*", help="text files to shard (default: the demo corpus)")
    p.add_argument("--repeat", type=int, default=4, help="copies of the demo corpus to shard")
    p.add_argument(
        "--doc-tokens", help="synthetic documents of these lengths in tokens instead, one set each: e.g. 100,500,1500"
    )
    p.add_argument("--set-tokens", type=int, default=600_000, help="tokens of each synthetic set")
    p.add_argument("--formats", default="2", help="shard formats to write and load, e.g. 1,2 (before and after)")
    p.add_argument("--compress", default="none", help="compressions of format 2 to write and load, e.g. none,zstd")
    p.add_argument(
        "--shard-mb", type=float, default=0.25, help="shard size (small: the loaders' streams get several shards)"
    )
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=50)
    p.add_argument("--train-steps", type=int, default=3, help="0 skips the training-step measurement")
    p.add_argument("--workers", type=int, default=os.cpu_count(), help="'all cores' (default: os.cpu_count())")
    p.add_argument("--streams", type=int, help="the loader's data.streams (default: the config's default)")
    p.add_argument("--http", action="store_true", help="also load (autoregressive) from an HTTP server on loopback")
    p.add_argument(
        "--manifest-shards", type=int, default=0, help="also time a loader over a manifest of this many shards"
    )
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one process, one core
    from data_pipeline.tokenizer import train_tokenizer

    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        files = prepare_corpus(args, work)
        tokenizer = work / "tokenizer.json"
        train_tokenizer(files[:1], args.vocab_size, tokenizer)
        sets = [("", files)]
        if args.doc_tokens:
            sets = [
                (
                    f"~{n}-token documents",
                    [str(synthetic_documents(files, tokenizer, n, args.set_tokens, work / f"{n}.jsonl"))],
                )
                for n in map(int, args.doc_tokens.split(","))
            ]
        objectives = OBJECTIVES[:1] if args.doc_tokens else OBJECTIVES
        for label, inputs in sets:
            if args.doc_tokens:
                (bare,) = bench_tokenizer(inputs, tokenizer)
                bare.update(input_bytes_per_token=Path(inputs[0]).stat().st_size / bare["tokens"])
                rows.append(bare)
            out = work / f"set-{len(rows)}"
            versions = tuple(map(int, args.formats.split(",")))
            compressions = tuple(None if c == "none" else c for c in args.compress.split(","))
            rows += bench_sharding(inputs, tokenizer, out, args.workers, versions, args.shard_mb, compressions)
            shards = {
                (v, c): str(format_directory(out, v, c, args.workers)) for v, c in shard_formats(versions, compressions)
            }
            rows += bench_loading(
                shards,
                tokenizer,
                args.seq_len,
                args.micro_batch,
                args.batches,
                args.workers,
                objectives,
                streams=args.streams,
            )
            if args.http:  # the same shards streamed from an HTTP server on this machine
                for key, directory in shards.items():
                    with http_server(Path(directory)) as url:
                        rows += bench_loading(
                            {key: url},
                            tokenizer,
                            args.seq_len,
                            args.micro_batch,
                            args.batches,
                            args.workers,
                            OBJECTIVES[:1],
                            where="http",
                            streams=args.streams,
                        )
            for row in rows:
                row.setdefault("set", label)
        if args.manifest_shards:
            last = Path(list(shards.values())[-1])
            rows += bench_many_shards(last, tokenizer, args.manifest_shards, args.seq_len, args.micro_batch, work)
        if args.train_steps:
            rows += bench_train_step(args.seq_len, args.micro_batch, args.train_steps, args.vocab_size)
    print(
        f"cores: {os.cpu_count()}, seq_len {args.seq_len}, micro batch {args.micro_batch}, "
        f"vocab {args.vocab_size}, {sys.version.split()[0]}"
    )
    for row in rows:
        what = row.get("objective") or row.get("model") or ""
        detail = f"workers={row['workers']}" if "workers" in row else row["precision"]
        detail += f" {row['from']}" if "from" in row else ""
        notes = [f"{row['tokens']:,} tokens in {row['seconds']:.2f} s"]
        if "real_tokens_per_s" in row:
            notes.append(f"{row['real_tokens_per_s']:,.0f} without padding")
        if "format" in row:
            notes.append(f"format {row['format']}" + (f" {row['compression']}" if row.get("compression") else ""))
        if row.get("set"):
            notes.append(row["set"])
        if row.get("bytes_per_token"):
            notes.append(f"{row['bytes_per_token']:.2f} bytes/token")
        if "build_s" in row:
            notes.append(f"{row['build_s']:.2f} s to build the loader, the rest to its first batch")
        if row.get("input_bytes_per_token"):
            notes.append(f"bare encode_batch, one thread; the .jsonl: {row['input_bytes_per_token']:.2f} bytes/token")
        print(f"{row['stage']:10s} {what:36s} {detail:10s} {row['tokens_per_s']:>12,.0f} tokens/s ({'; '.join(notes)})")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
