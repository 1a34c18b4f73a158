"""``megatransformer quickstart``: corpus -> tokenizer -> shards -> a few minutes of training, all local.

The corpus is the Python standard library's docstrings, so nothing is downloaded. Data preparation is
skipped when the files already exist; training resumes (resume=auto) when the run directory has a checkpoint.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatransformer.commands.arguments import add_config_argument


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "quickstart",
        help="prepare a demo corpus and train the quickstart config",
        description="Write a corpus of Python docstrings, train a tokenizer, shard, and train a small model; all "
        "files land under the config's run_dir, relative to the current directory.",
    )
    add_config_argument(parser, default="quickstart")
    parser.add_argument(
        "overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. train.max_steps=50"
    )
    parser.add_argument("--verbose", action="store_true", help="also show DeepSpeed's start-up messages")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from data_pipeline.corpus import write_demo_corpus
    from data_pipeline.shard import MANIFEST, write_shards
    from data_pipeline.tokenizer import train_tokenizer
    from megatransformer.commands.train import train
    from megatransformer.config import load_config

    cfg = load_config(args.config, args.overrides)
    tokenizer, shards = Path(cfg.data.tokenizer), Path(cfg.data.train)
    corpus = tokenizer.parent / "corpus.txt"
    if not corpus.is_file():
        print(f"[1/4] writing a corpus of Python standard-library docstrings to {corpus}")
        write_demo_corpus(corpus)
    if not tokenizer.is_file():
        print(f"[2/4] training a {cfg.model.vocab_size}-token byte-level BPE tokenizer -> {tokenizer}")
        train_tokenizer([str(corpus)], cfg.model.vocab_size, tokenizer)
    if not (shards / MANIFEST).is_file():
        print(f"[3/4] tokenizing into WebDataset shards -> {shards}")
        write_shards(
            [str(corpus)], str(tokenizer), shards, shard_mb=1.0, valid_every=50, overwrite=True, progress=False
        )
    print(f"[4/4] training {args.config} (metrics in {cfg.run_dir}/metrics.jsonl)")
    return train(args.config, ["resume=auto", *args.overrides], args.verbose)
