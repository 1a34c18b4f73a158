"""``megatransformer checkpoint convert``: a checkpoint of the format before shards, rewritten as a sharded one
that resumes on any layout (docs/checkpoints.md)."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "checkpoint",
        help="convert a checkpoint of the format before shards",
        description="Rewrite checkpoints written before sharded checkpoints (DeepSpeed's states beside "
        "model.safetensors and optimizer.safetensors) in the sharded format, in place, so that they resume.",
    )
    actions = p.add_subparsers(dest="action", required=True)
    convert = actions.add_parser(
        "convert",
        help="convert a step directory in place",
        description="Rewrite one step directory of the format before shards in the sharded format, in place; "
        "a sharded checkpoint is left as it is.",
    )
    convert.add_argument("checkpoint", help="a step_NNNNNN directory")
    convert.set_defaults(func=convert_checkpoint)


def convert_checkpoint(args: argparse.Namespace) -> int:
    from pathlib import Path

    from megatransformer.checkpoint import find_checkpoint
    from megatransformer.checkpoint.sharded import INDEX, convert_consolidated, finish_conversions

    given = Path(args.checkpoint)
    if given.parent.is_dir():  # (a conversion a kill cut short, of this checkpoint or another one beside it)
        for line in finish_conversions(given.parent):
            print(line)
    path = find_checkpoint(given, args.checkpoint)
    if (path / INDEX).is_file():
        print(f"{path} is sharded already: nothing to do")
        return 0
    convert_consolidated(path)
    print(f"converted {path}: it resumes on any layout (resume={path})")
    return 0
