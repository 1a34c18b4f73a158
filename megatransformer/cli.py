"""The ``megatransformer`` command: one sub-command per module, registered from a table.

Each module in ``COMMANDS`` defines ``register(subparsers)``, which adds its parser and sets ``func``
(called with the parsed arguments, returning an exit code). Modules import heavy libraries (torch,
deepspeed) inside their functions so that ``megatransformer --help`` stays instant.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from data_pipeline import DataError
from megatransformer.config import ConfigError

COMMANDS = (
    "megatransformer.commands.info",
    "data_pipeline.cli",
    "megatransformer.training.cli",
    "megatransformer.commands.quickstart",
    "megatransformer.commands.generate",
    "megatransformer.commands.export",
    "megatransformer.commands.eval",
    "megatransformer.commands.average",
    "megatransformer.commands.plot",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megatransformer", description=__doc__.splitlines()[0])
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, DataError) as err:
        print(f"megatransformer {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
