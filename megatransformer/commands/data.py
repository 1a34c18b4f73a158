"""``megatransformer data tokenizer | shard | merge | inspect | demo-corpus``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_pipeline import DataError
from megatransformer.commands.arguments import add_config_argument
from megatransformer.console import to_stderr

INPUT_HELP = (
    ".txt / .jsonl / .tsv files (.gz/.zst too), .parquet / .arrow files, directories of them, or a "
    "`datasets` save_to_disk directory"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    data = subparsers.add_parser(
        "data",
        help="prepare and inspect training data",
        description="Turn text into what training reads: a tokenizer, then WebDataset "
        "shards; inspect the batches a config makes of them.",
    )
    commands = data.add_subparsers(dest="data_command", required=True, metavar="STEP")

    p = commands.add_parser(
        "tokenizer",
        help="train a byte-level BPE tokenizer with the special tokens",
        description="Train a byte-level BPE tokenizer on text files and write it as a "
        "Hugging Face tokenizer.json, with pad, bos, eos, mask and sentinel tokens.",
    )
    p.add_argument("--input", nargs="+", required=True, help=INPUT_HELP)
    p.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        help="tokens to learn (the result has fewer when the corpus runs out of merges)",
    )
    p.add_argument("--sentinels", type=int, default=100, help="span-corruption sentinel tokens")
    p.add_argument("--text-field", default="text", help="field of .jsonl records holding the text")
    p.add_argument(
        "--doc-per",
        choices=["block", "file"],
        default="block",
        help=".txt documents: blank-line-separated blocks or whole files",
    )
    p.add_argument("--out", required=True, help="tokenizer.json to write")
    p.set_defaults(func=_tokenizer)

    p = commands.add_parser(
        "shard",
        help="tokenize documents into WebDataset shards + manifest.json",
        description="Tokenize documents (or instruction and translation pairs) into "
        "WebDataset shards of a train and a valid split, listed with their "
        "checksums in manifest.json; data.train= takes the directory.",
    )
    p.add_argument("--input", nargs="+", required=True, help=INPUT_HELP)
    p.add_argument("--tokenizer", required=True, help="tokenizer.json")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--shard-mb", type=float, default=256.0, help="approximate shard size in MiB")
    p.add_argument(
        "--valid-every",
        type=int,
        default=None,
        metavar="N",
        help="hold out every N-th document for validation (0: none; default: every 10th of the first "
        "1,000 documents, every 100th after)",
    )
    p.add_argument(
        "--workers",
        type=int,
        default=None,
        help="tokenizer processes (default: cores - 1, no more than a plain-text input has 2 MiB batches; 1: in this "
        "process, multi-threaded)",
    )
    p.add_argument("--text-field", default="text", help="field of .jsonl records holding the text")
    p.add_argument(
        "--doc-per",
        choices=["block", "file"],
        default="block",
        help=".txt documents: blank-line-separated blocks or whole files",
    )
    p.add_argument(
        "--on-decode-error",
        choices=["replace", "fail"],
        default="replace",
        help="invalid UTF-8 in the input: replace the bad bytes (warned about) or stop",
    )
    p.add_argument(
        "--compress",
        choices=["none", "zstd"],
        default="none",
        help="zstd: compress each sample's arrays on their own (members named *.npy.zst; docs/data.md)",
    )
    p.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    p.add_argument(
        "--part",
        type=part_argument,
        default=None,
        metavar="K/N",
        help="tokenize only the K-th of N equal parts of the input's text (whole segments: runs of files and "
        ".parquet row groups holding 8 x --shard-mb of text) into --out/part-K-of-N, e.g. one task of a Slurm "
        "array; `data merge --out` joins the N parts into the shards one run writes",
    )
    add_instruction_arguments(p)
    p.set_defaults(func=_shard)

    p = commands.add_parser(
        "merge",
        help="join the parts written by `data shard --part K/N` into one dataset",
        description="Check that every part of --out is finished, intact and made from the same input, "
        "settings and tokenizer, then write the manifest that makes --out one dataset (the shards stay "
        "where the parts wrote them).",
    )
    p.add_argument("--out", required=True, help="the --out of the `data shard --part` runs")
    p.add_argument("--overwrite", action="store_true", help="replace a different manifest already in --out")
    p.set_defaults(func=_merge)

    p = commands.add_parser(
        "inspect",
        help="decode a few batches of a run config and print statistics",
        description="Build a config's data loader, decode its first batches back to text and "
        "print how full they are (padding, documents per row, loss tokens).",
    )
    add_config_argument(p)
    p.add_argument("--batches", type=int, default=2, help="micro batches to decode")
    p.add_argument("--split", choices=["train", "valid"], default="train", help="which split to read")
    p.add_argument("--json", action="store_true", help="print the statistics as JSON")
    p.add_argument(
        "--rows",
        type=row_range,
        default=None,
        metavar="START:STOP",
        help="instead, print global training rows [START, STOP) as text (e.g. a range a loss-spike "
        "rollback skipped: metrics.jsonl's skipped_rows)",
    )
    p.add_argument("overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. data.seq_len=256")
    p.set_defaults(func=_inspect)

    p = commands.add_parser(
        "demo-corpus",
        help="write a text corpus from the Python standard library's docstrings",
        description="Write the docstrings of the Python standard library as a text corpus "
        "(blank-line-separated documents): data to try every step on, offline.",
    )
    p.add_argument("--out", required=True, help="text file to write")
    p.add_argument("--max-mb", type=float, default=2.0, help="corpus size in MB")
    p.set_defaults(func=_demo_corpus)


def add_instruction_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prompt-field",
        default=None,
        help="read .jsonl records as instruction examples: this field is the prompt (context only, "
        "no loss), --completion-field the text the model learns",
    )
    p.add_argument("--completion-field", default="completion", help="with --prompt-field: the completion field")
    # Translation pairs are (prompt, completion) examples: the same options under the names of the field.
    p.add_argument(
        "--source-field",
        dest="prompt_field",
        default=argparse.SUPPRESS,
        metavar="FIELD",
        help="translation pairs (.jsonl or .tsv): the source side, read like --prompt-field",
    )
    p.add_argument(
        "--target-field",
        dest="completion_field",
        default=argparse.SUPPRESS,
        metavar="FIELD",
        help="translation pairs: the target side, read like --completion-field",
    )


def _guard(fn):
    def run(args: argparse.Namespace) -> int:
        try:
            return fn(args)
        except DataError as err:
            to_stderr(f"megatransformer data {args.data_command}: error: {err}")
            return 2

    return run


def _input_files(names: list[str]) -> list[str]:
    """``--input`` as files; a note on stderr names the files of its directories that are not read."""
    from data_pipeline.documents import files_not_read, input_files

    files = input_files(names)
    skipped = files_not_read(names)
    if skipped:
        shown = ", ".join(skipped[:3]) + (f" and {len(skipped) - 3} more" if len(skipped) > 3 else "")
        to_stderr(
            f"note: not reading {shown}: --input reads .txt, .jsonl, .json and .tsv files (plain, .gz or .zst), "
            ".parquet and .arrow files of a directory; name other files one by one",
        )
    return files


@_guard
def _tokenizer(args: argparse.Namespace) -> int:
    files = _input_files(args.input)
    print(f"training a {args.vocab_size:,}-token tokenizer on {len(files)} file(s): reading every document", flush=True)
    from data_pipeline.tokenizer import train_tokenizer

    info = train_tokenizer(
        files, args.vocab_size, args.out, args.sentinels, args.text_field, args.doc_per, progress=sys.stderr.isatty()
    )
    asked = "" if info.vocab_size == args.vocab_size else f" of {args.vocab_size} asked"
    print(
        f"wrote {args.out}: {info.vocab_size} tokens{asked} (pad {info.pad_id}, bos {info.bos_id}, eos {info.eos_id}, "
        f"mask {info.mask_id}, {len(info.sentinel_ids)} sentinels)"
    )
    return 0


@_guard
def _shard(args: argparse.Namespace) -> int:
    files = _input_files(args.input)
    print(f"sharding {len(files)} file(s) with {args.tokenizer} into {args.out}", flush=True)  # (as data tokenizer)
    from data_pipeline.shard import SEGMENT_SHARDS, write_shards

    text_field = args.completion_field if args.prompt_field else args.text_field
    manifest = write_shards(
        files,
        args.tokenizer,
        args.out,
        args.shard_mb,
        args.valid_every,
        args.workers,
        text_field,
        args.doc_per,
        args.on_decode_error,
        args.overwrite,
        progress=sys.stderr.isatty(),
        prompt_field=args.prompt_field,
        part=args.part,
        compression=None if args.compress == "none" else args.compress,
    )
    _print_splits(manifest, "examples" if args.prompt_field else "documents")
    if args.part:
        k, n = args.part
        if not manifest.documents:
            print(
                f"part {k}/{n} holds no document: its files hold none, or the input has fewer segments (runs of "
                f"files holding {SEGMENT_SHARDS} x --shard-mb of text) than {n} parts"
            )
        print(
            f"part {k}/{n} is finished; once all {n} are, join them with `megatransformer data merge --out {args.out}`"
        )
    return 0


@_guard
def _merge(args: argparse.Namespace) -> int:
    from data_pipeline.merge import merge_parts
    from data_pipeline.shard import INSTRUCTIONS, MANIFEST

    manifest = merge_parts(args.out, args.overwrite)
    _print_splits(manifest, "examples" if manifest.kind == INSTRUCTIONS else "documents")
    print(f"wrote {Path(args.out) / MANIFEST}: data.train={args.out} reads the merged dataset")
    return 0


def _print_splits(manifest, unit: str) -> None:
    import numpy as np

    for split, shards in manifest.splits.items():
        print(
            f"{split}: {len(shards)} shards, {sum(s.documents for s in shards):,} {unit}, "
            f"{manifest.tokens(split):,} tokens ({manifest.dtype})"
        )
    if manifest.splits and manifest.bytes_per_token() is not None:
        payload = np.dtype(manifest.dtype).itemsize
        compressed = f", {manifest.compression}-compressed" if manifest.compression else ""
        print(
            f"{manifest.bytes_per_token():.2f} bytes per token on disk ({manifest.bytes_per_token() / payload:.2f}x "
            f"the {manifest.dtype} ids{compressed})"
        )


def part_argument(text: str) -> tuple[int, int]:
    from data_pipeline.parts import parse_part

    try:
        return parse_part(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def row_range(text: str) -> tuple[int, int]:
    """``START:STOP``, two global row numbers with START < STOP."""
    start, sep, stop = text.partition(":")
    if not (sep and start.isdigit() and stop.isdigit() and int(start) < int(stop)):
        raise argparse.ArgumentTypeError(f"{text!r} is not START:STOP with 0 <= START < STOP, e.g. 1200:1600")
    return int(start), int(stop)


@_guard
def _inspect(args: argparse.Namespace) -> int:
    from data_pipeline.inspect import inspect_batches, inspect_rows
    from megatransformer.config import load_config
    from megatransformer.training.data import loader_settings

    cfg = load_config(args.config, args.overrides)
    if args.rows is not None:
        return inspect_rows(loader_settings(cfg), cfg.data.tokenizer, *args.rows)
    return inspect_batches(
        loader_settings(cfg), cfg.data.tokenizer, cfg.train.micro_batch_size or 4, args.batches, args.split, args.json
    )


@_guard
def _demo_corpus(args: argparse.Namespace) -> int:
    from data_pipeline.corpus import write_demo_corpus

    path = write_demo_corpus(args.out, int(args.max_mb * 1e6))
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")
    return 0
