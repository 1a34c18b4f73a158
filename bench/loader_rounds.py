"""The loader on short and long documents in alternating rounds, each measurement a fresh process; optionally
the same against another checkout of the code (a git worktree of an earlier commit), side by side.

    python bench/loader_rounds.py --doc-tokens 100,1500 --rounds 5
    git worktree add /tmp/before <commit> && python bench/loader_rounds.py --trees /tmp/before,.

Each set is ``--set-tokens`` tokens of synthetic documents (bench/data.py's: random runs of the demo corpus's
words) sharded once with this checkout's writer (format 2, ``--shard-mb`` shards). A measurement is the
autoregressive loader (decoder, ``--seq-len``, micro batch ``--micro-batch``, the main process) reading
``--batches`` batches after two of warm-up. Prints every round, then per tree and length the median tokens/s, the
short/long ratio per round and, with two trees, the second against the first.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

WORKER = """
import sys, time, warnings
warnings.filterwarnings("ignore")
from data_pipeline.tokenizer import load_tokenizer
from megatransformer.config import validate
from megatransformer.training.data import build_run_loader
shards, tokenizer = sys.argv[1:3]
seq_len, micro, batches = map(int, sys.argv[3:6])
tok = load_tokenizer(tokenizer)
cfg = validate({"model": {"arch": "decoder", "vocab_size": tok.vocab_size, "max_seq_len": seq_len},
                "data": {"train": shards, "tokenizer": tokenizer, "seq_len": seq_len, "num_workers": 0},
                "objective": "autoregressive"})
batch_iter = iter(build_run_loader(cfg, "train", micro, 0, 1, tok))
for _ in range(2):
    next(batch_iter)
started, tokens = time.perf_counter(), 0
for _ in range(batches):
    tokens += next(batch_iter)["input_ids"].numel()
print(tokens / (time.perf_counter() - started))
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--doc-tokens", default="100,1500", help="document lengths, the shortest first")
    p.add_argument("--set-tokens", type=int, default=12_000_000)
    p.add_argument("--shard-mb", type=float, default=16)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--batches", type=int, default=1000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--trees", default=str(HERE.parent), help="code checkouts to compare, comma-separated")
    p.add_argument("--work", type=Path, default=Path("/tmp/mt-loader-rounds"), help="sets are kept here")
    return p.parse_args(argv)


def prepare(args: argparse.Namespace, lengths: list[int]) -> tuple[Path, dict[int, Path]]:
    """The tokenizer and one shard directory per length (made once, kept in --work)."""
    from data import synthetic_documents

    from data_pipeline.corpus import write_demo_corpus
    from data_pipeline.shard import write_shards
    from data_pipeline.tokenizer import train_tokenizer

    args.work.mkdir(parents=True, exist_ok=True)
    tokenizer = args.work / f"tokenizer-{args.vocab_size}.json"
    corpus = write_demo_corpus(args.work / "demo.txt", max_bytes=10**9)
    if not tokenizer.exists():
        train_tokenizer([str(corpus)], args.vocab_size, tokenizer)
    sets = {}
    for n in lengths:
        sets[n] = args.work / f"shards-{n}-{args.set_tokens}-{args.vocab_size}-{args.shard_mb}"
        if not (sets[n] / "manifest.json").exists():
            docs = synthetic_documents([str(corpus)], tokenizer, n, args.set_tokens, args.work / f"docs-{n}.jsonl")
            write_shards([str(docs)], str(tokenizer), sets[n], shard_mb=args.shard_mb, progress=False, overwrite=True)
    return tokenizer, sets


def measure(tree: str, shards: Path, tokenizer: Path, args: argparse.Namespace) -> float:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-c", WORKER, str(shards), str(tokenizer)]
    command += [str(args.seq_len), str(args.micro_batch), str(args.batches)]
    out = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    if out.returncode:
        raise SystemExit(f"the loader in {tree} failed: {out.stderr.strip().splitlines()[-1]}")
    return float(out.stdout.split()[-1])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    lengths = [int(n) for n in args.doc_tokens.split(",")]
    trees = [str(Path(t).resolve()) for t in args.trees.split(",")]
    tokenizer, sets = prepare(args, lengths)
    print(f"# {time.strftime('%Y-%m-%d')} {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f} at the start")
    print(f"# command: python bench/loader_rounds.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    results: dict[tuple[str, int], list[float]] = {(t, n): [] for t in trees for n in lengths}
    for r in range(1, args.rounds + 1):
        line = []
        for tree in trees:
            for n in lengths:
                results[tree, n].append(measure(tree, sets[n], tokenizer, args))
                line.append(f"{Path(tree).name} {n}: {results[tree, n][-1] / 1e6:.2f}M")
        print(f"# round {r}: " + ", ".join(line), flush=True)
    short, long = lengths[0], lengths[-1]
    print("| tree | documents of ~ | tokens/s median (min-max) | short / long per round (median) |")
    print("|---|---|---|---|")
    for tree in trees:
        ratios = [s / lo for s, lo in zip(results[tree, short], results[tree, long])]
        for n in lengths:
            values = results[tree, n]
            ratio = f"{', '.join(f'{x:.2f}' for x in ratios)} ({statistics.median(ratios):.2f})" if n == short else ""
            print(
                f"| {tree} | {n} | {statistics.median(values) / 1e6:.2f}M "
                f"({min(values) / 1e6:.2f}-{max(values) / 1e6:.2f}) | {ratio} |"
            )
    if len(trees) == 2:
        for n in lengths:
            per_round = [b / a for a, b in zip(results[trees[0], n], results[trees[1], n])]
            print(
                f"# ~{n} tokens: {Path(trees[1]).name} / {Path(trees[0]).name} per round "
                f"{', '.join(f'{x:.2f}' for x in per_round)} (median {statistics.median(per_round):.2f})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
