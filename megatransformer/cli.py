"""The ``megatransformer`` command: one sub-command per module of ``commands/``, registered from a table.

Each module in ``COMMANDS`` defines ``register(subparsers)``, which adds its parser and sets ``func``
(called with the parsed arguments, returning an exit code). Modules import heavy libraries (torch,
deepspeed) inside their functions so that ``megatransformer --help`` stays instant.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import os
import signal
import sys
from typing import NoReturn

from data_pipeline import DataError, WriteFailed
from megatransformer.config import ConfigError
from megatransformer.console import to_stderr

EXIT_WRITE_FAILED = 5  # a file could not be written (disk full, quota, I/O error); what was intact stays so
# the commands that run PyTorch's kernels: they pick their threads for the machine (training/threads.py)
COMPUTING = ("train", "quickstart", "eval", "generate", "plan")

COMMANDS = (
    "megatransformer.commands.info",
    "megatransformer.commands.plan",
    "megatransformer.commands.data",
    "megatransformer.commands.train",
    "megatransformer.commands.quickstart",
    "megatransformer.commands.generate",
    "megatransformer.commands.export",
    "megatransformer.commands.eval",
    "megatransformer.commands.average",
    "megatransformer.commands.plot",
    "megatransformer.commands.checkpoint",
)


DESCRIPTION = """\
Pretrain Transformer language models (decoder, encoder, encoder-decoder) from one YAML config plus
key.path=value overrides, on a laptop CPU or many GPU nodes.

Start with `megatransformer quickstart` (a small model on a local corpus, a few minutes on a CPU). A config is a
YAML path or the name of a shipped one: quickstart, llama-style, bert-style, t5-style, transformer-base,
transformer-big. `megatransformer COMMAND --help` describes each command."""

EPILOG = """\
typical session:
  megatransformer data tokenizer --input corpus.txt --vocab-size 32000 --out data/pretrain/tokenizer.json
  megatransformer data shard --input corpus.txt --tokenizer data/pretrain/tokenizer.json --out data/pretrain/shards
  megatransformer train --config llama-style train.max_steps=1000
  megatransformer eval --checkpoint runs/llama-style --data data/pretrain/shards"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows each option's default, except the ones that say nothing (None, an unset flag); keeps the
    line breaks of descriptions and epilogs."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose sub-parsers (created through add_subparsers) use :class:`HelpFormatter`."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="megatransformer", description=DESCRIPTION, epilog=EPILOG)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS:
        importlib.import_module(module).register(subparsers)
    return parser


def is_override(arg: str) -> bool:
    """Whether a command-line word is a ``key.path=value`` override: its first key is a section or field of
    the run config (``data.seq_len=64``, ``seed=1``), so a file name holding '=' is not mistaken for one."""
    from megatransformer.config import RunConfig

    key, sep, _ = arg.partition("=")
    return bool(sep) and key.split(".")[0] in RunConfig.model_fields


def parse_args(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, letting overrides come anywhere after the sub-command's options: argparse alone would read
    ``--data a.txt data.seq_len=64`` as two data files, and reject overrides that follow an option."""
    args, extra = parser.parse_known_args(argv)
    if not hasattr(args, "overrides"):  # a command without overrides: plain argparse rules
        return parser.parse_args(argv)
    stray = [arg for arg in extra if not is_override(arg)]
    if stray:
        parser.parse_args(argv)  # argparse's own message and exit 2
    moved = list(extra)
    for name, value in vars(args).items():
        if name != "overrides" and isinstance(value, list) and any(map(is_override, value)):
            moved += [v for v in value if is_override(v)]
            kept = [v for v in value if not is_override(v)]
            if not kept:
                parser.exit(
                    2,
                    f"megatransformer {args.command}: error: --{name.replace('_', '-')} needs a value "
                    f"that is not a key.path=value override\n",
                )
            setattr(args, name, kept)
    given = set(moved) | set(args.overrides or [])
    args.overrides = [arg for arg in (sys.argv[1:] if argv is None else argv) if arg in given]  # in their order
    return args


def main(argv: list[str] | None = None) -> int:
    if "TORCHELASTIC_RUN_ID" in os.environ:  # (from the start: a launcher killed during the imports ends this too)
        from megatransformer.training.runtime.distributed import end_with_launcher

        end_with_launcher()
    args = parse_args(build_parser(), argv)
    if args.command in COMPUTING:  # (before torch loads libgomp, which reads it once)
        from megatransformer.training.threads import set_wait_policy

        set_wait_policy()
    try:
        return int(args.func(args) or 0)
    except (ConfigError, DataError) as err:
        from megatransformer.training.runtime import failure_board

        if reports_errors():
            to_stderr(f"megatransformer {args.command}: error: {err}")
            failure_board.say_printed()
        else:
            failure_board.wait_until_printed()
        return 2
    except WriteFailed as err:  # (each rank its own: which rank's disk filled up matters)
        to_stderr(f"megatransformer {args.command}: error: {err}")
        return EXIT_WRITE_FAILED
    except KeyboardInterrupt:  # (train checkpoints on Ctrl-C once it has started: training/loop.py)
        to_stderr(f"\nmegatransformer {args.command}: interrupted")
        return 128 + signal.SIGINT  # as a shell reports a process ended by Ctrl-C


def command() -> NoReturn:
    """The ``megatransformer`` command as a process: :func:`main`, then :func:`end_process`."""
    end_process(main())


def end_process(code: int) -> NoReturn:
    """Exit with ``code`` through the interpreter's shutdown (exit handlers included), every object frozen out
    of the garbage collector first: its collections at shutdown would walk all that PyTorch and DeepSpeed
    loaded (about a second a process) to free memory the process returns anyway. Not for in-process callers."""
    gc.freeze()
    sys.exit(code)


def reports_errors() -> bool:
    """Whether this process prints a config or data error. The ranks of a node read the same config and
    files, so an error found before the process group starts is the same on each: local rank 0 prints it.
    Once the group has started, an error may be one rank's own, and every rank prints its own (also after the
    group has ended: a run ends its groups before it stops with the error)."""
    distributed = sys.modules.get("megatransformer.training.runtime.distributed")
    started = distributed is not None and distributed.group_started()
    return started or os.environ.get("LOCAL_RANK", "0") == "0"


if __name__ == "__main__":
    command()
