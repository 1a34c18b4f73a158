"""``megatransformer info``: the resolved config, parameter counts and training FLOPs per token."""

from __future__ import annotations

import argparse
import json

from megatransformer.commands.arguments import add_config_argument
from megatransformer.config import dump_config, load_config


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "info",
        help="show a config's resolved values, parameters and FLOPs/token",
        description="Print a config with every default filled in and the overrides "
        "applied, and its model's parameter count and FLOPs per token.",
    )
    add_config_argument(parser)
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    parser.add_argument(
        "overrides", nargs="*", metavar="key.path=value", help="config overrides, e.g. model.n_layers=4"
    )
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from megatransformer.flops import model_size

    cfg = load_config(args.config, args.overrides)
    size = model_size(cfg.model, cfg.data.seq_len)
    if args.json:
        print(json.dumps({"config": cfg.model_dump(mode="json"), **size.as_dict()}, indent=2))
        return 0
    print(dump_config(cfg), end="")
    print("---")
    print(f"parameters:               {size.params:,} ({size.params / 1e6:.2f} M)")
    print(f"non-embedding parameters: {size.non_embedding_params:,} ({size.non_embedding_params / 1e6:.2f} M)")
    print(f"training FLOPs per token: {size.flops_per_token:.4g} (seq_len {size.seq_len})")
    return 0
