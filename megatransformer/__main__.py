"""``python -m megatransformer``: the ``megatransformer`` command, where its script is not on PATH."""

from megatransformer.cli import command

command()
