"""Command-line arguments that several commands share."""

from __future__ import annotations

import argparse


def add_config_argument(parser: argparse.ArgumentParser, default: str | None = None) -> None:
    """``--config``: a YAML file or a shipped config's name (required unless ``default`` is given)."""
    from megatransformer.config import shipped_configs

    parser.add_argument(
        "--config",
        required=default is None,
        default=default,
        help=f"the run's YAML file, or one of the shipped configs by name: {', '.join(shipped_configs())}",
    )


def add_zero_stage_argument(parser: argparse.ArgumentParser) -> None:
    """``--zero-stage``: the whole model on each process, or partitioned over torchrun's ranks (:func:`zero_stage`)."""
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 3],
        default=0,
        help="0: each torchrun rank holds the whole model; 3: a part of it, for a model larger than one device "
        "(ZeRO-3: each forward gathers a layer's parameters from every rank, the ranks running every forward "
        "together), under torchrun with 2 or more ranks",
    )


def zero_stage(args: argparse.Namespace) -> int:
    """``--zero-stage``, refused in one line at 3 on one process: it partitions the model over torchrun's ranks."""
    import os

    from megatransformer.config import ConfigError

    if args.zero_stage == 3 and int(os.environ.get("WORLD_SIZE", 1)) == 1:
        raise ConfigError("--zero-stage 3 partitions the model over torchrun's ranks: run it under torchrun, 2 or more")
    return args.zero_stage


def add_dtype_argument(parser: argparse.ArgumentParser) -> None:
    """``--dtype``: the precision a checkpoint's model runs in, for eval and generate."""
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="the weights' and activations' dtype: bf16 halves the model's memory (a bf16 run's own weights)",
    )


def add_beam_arguments(p: argparse.ArgumentParser) -> None:
    """Beam search options: generate's and eval --bleu's."""
    p.add_argument(
        "--num-beams",
        type=int,
        default=1,
        help="beam search with this many beams (generate: 1 samples as --temperature says; eval --bleu: 1 is greedy)",
    )
    p.add_argument(
        "--length-penalty",
        type=float,
        default=0.6,
        help="beam search: alpha of the length penalty (the 2017 paper: 0.6)",
    )
    p.add_argument(
        "--length-penalty-form",
        choices=["gnmt", "hf"],
        default="gnmt",
        help="gnmt: score / ((5 + |Y|) / 6) ** alpha; hf: score / |Y| ** alpha, as transformers",
    )
