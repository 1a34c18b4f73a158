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
