"""``megatransformer average``: the parameter mean of several checkpoints, as one checkpoint.

Vaswani et al. (2017) evaluated the average of the last 5 (base) or 20 (big) checkpoints, written at
10-minute intervals. The mean is taken in fp32 (accumulated in fp64) over the whole weights of each checkpoint,
a tensor at a time (a training checkpoint's shards assembled one tensor at a time), so any training layout
(data/tensor parallel, ZeRO stage) and any model size can be averaged; the result is a weights-only checkpoint
directory that ``eval``, ``generate``, ``export`` and ``init_from=`` accept. It takes the config and tokenizer of
the newest checkpoint given; all must have the same model shape and tokenizer.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "average",
        help="average the weights of checkpoints (e.g. the last 5 of a run)",
        description="Write the parameter mean of several checkpoints of one model as a "
        "weights-only checkpoint (the 2017 paper evaluated the last 5 or 20).",
    )
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--checkpoints",
        nargs="+",
        metavar="C",
        help="checkpoint (step) directories to average (a run directory: its latest checkpoint)",
    )
    which.add_argument(
        "--last",
        nargs=2,
        metavar=("N", "RUN_DIR"),
        help="the last N complete checkpoints of a run directory (or its checkpoints directory)",
    )
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatransformer.checkpoint import write_weights_checkpoint

    sources = last_checkpoints(*args.last) if args.last else [Path(c) for c in args.checkpoints]
    cfg, weights, tokenizer = average_checkpoints(sources)
    write_weights_checkpoint(args.out, cfg, weights, tokenizer)
    print(f"averaged {len(sources)} checkpoints ({', '.join(p.name for p in sources)}) -> {args.out}")
    return 0


def last_checkpoints(n: str, run_dir: str) -> list[Path]:
    """The last ``n`` complete step directories of a run (or checkpoints) directory, oldest first."""
    from megatransformer.checkpoint import checkpoints_dir, complete_checkpoints
    from megatransformer.config import ConfigError

    if not n.isdigit() or int(n) < 1:
        raise ConfigError(f"--last N RUN_DIR: N must be a positive integer, got {n!r}")
    root = checkpoints_dir(run_dir) if checkpoints_dir(run_dir).is_dir() else Path(run_dir)
    complete = complete_checkpoints(root)[::-1]
    if len(complete) < int(n):
        raise ConfigError(
            f"--last {n} {run_dir}: only {len(complete)} complete checkpoints in {root}"
            + (f" ({_fewer_why(complete[-1], int(n))})" if complete else "")
        )
    return complete[-int(n) :]


def _fewer_why(newest: Path, wanted: int) -> str:
    """Why a run holds fewer checkpoints than ``wanted``, from its newest checkpoint's config."""
    from megatransformer.checkpoint import saved_config

    saved = saved_config(newest).checkpoint
    if saved.keep < wanted:
        return f"the run kept its last checkpoint.keep={saved.keep}; raise checkpoint.keep to keep more of them"
    return (
        f"the run wrote no more: one every checkpoint.every={saved.every} steps and one at its end; lower "
        "checkpoint.every or train longer"
    )


def average_checkpoints(paths: list[Path]):
    """(config, fp32 mean weights as (name, tensor) pairs, tokenizer.json path or None) of ``paths``; each mean is
    taken when the pair is, from one tensor of each checkpoint, so one tensor's sum is held at a time. The
    config and tokenizer are the last checkpoint's. Refuses checkpoints of another model shape or tokenizer than
    the first."""
    from megatransformer.checkpoint import SHAPE_FIELDS, find_checkpoint, load_weights
    from megatransformer.config import ConfigError

    # a run or checkpoints directory stands for its latest checkpoint
    paths = [find_checkpoint(p, f"--checkpoints {p}") for p in paths]
    sources = []
    first_cfg, first_tokenizer = None, None
    for path in paths:
        cfg, weights = load_weights(path, lazy=True)
        sources.append(weights)
        tokenizer = path / "tokenizer.json"
        tokenizer_bytes = tokenizer.read_bytes() if tokenizer.is_file() else None
        if first_cfg is None:
            first_cfg, first_tokenizer = cfg, tokenizer_bytes
            continue
        diffs = [
            f"model.{f}={getattr(cfg.model, f)} (not {getattr(first_cfg.model, f)})"
            for f in SHAPE_FIELDS
            if getattr(cfg.model, f) != getattr(first_cfg.model, f)
        ]
        if diffs:
            raise ConfigError(
                f"cannot average checkpoints of different model shapes: {path} has {', '.join(diffs)} of {paths[0]}"
            )
        if tokenizer_bytes != first_tokenizer:
            raise ConfigError(
                f"checkpoint {path} has another tokenizer.json than {paths[0]}: average checkpoints of one run only"
            )
    tokenizer = paths[-1] / "tokenizer.json"
    return cfg, _means(sources), tokenizer if tokenizer.is_file() else None


def _means(sources: list[Mapping[str, Any]]) -> Iterator[tuple[str, Any]]:
    """Each tensor's mean over ``sources`` in fp32, accumulated in fp64."""
    for name in sources[0]:
        total = sources[0][name].double()
        for weights in sources[1:]:
            total += weights[name].double()
        yield name, (total / len(sources)).float()
