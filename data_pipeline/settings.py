"""The data pipeline's own settings, which the run config composes (its ``data`` section and ``objective_args``):
typed, range-checked and documented field by field here, so that nothing mirrors them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, NonNegativeInt, PositiveFloat, PositiveInt
from pydantic.dataclasses import dataclass as settings

from data_pipeline import DataError

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]
SETTINGS = ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False)
"""Unknown keys are errors, attribute docstrings document the fields, no float is NaN or infinite."""


@settings(frozen=True, config=SETTINGS)
class Dataset:
    """One dataset of a mixture (an entry of ``data.train`` / ``data.valid``): a shard directory and its weight."""

    path: str
    """A shard directory holding manifest.json (written by `megatransformer data shard`): a local path or an
    http(s)://, s3:// or gs:// URL."""
    weight: PositiveFloat = 1.0
    """Relative sampling weight when several datasets are mixed."""


Datasets = str | list[Dataset] | None
"""A shard directory (or URL), or datasets to mix."""


@settings(frozen=True, config=SETTINGS)
class DataSettings:
    """Which shards to read and how they become rows (the run config's ``data`` section)."""

    train: Datasets = None
    """Training shards: a shard directory (local path or http(s)://, s3://, gs:// URL), or a list of
    {path, weight} to mix."""
    valid: Datasets = None
    """Validation shards (same forms as train); defaults to the validation split of train."""
    tokenizer: str | None = None
    """A Hugging Face tokenizer.json; special-token ids are read from it."""
    seq_len: PositiveInt = 512
    """Tokens per training sequence (encoder input length for encoder_decoder objectives)."""
    pack: bool = True
    """Pack documents into full sequences (with document boundaries); false pads each document."""
    shuffle_buffer: NonNegativeInt = 1000
    """Documents shuffled together: shards are read in blocks of this many documents, each block permuted."""
    num_workers: NonNegativeInt = 0
    """DataLoader worker processes per rank."""
    on_corrupt: Literal["error", "skip"] = "error"
    """A corrupt shard stops the run (error) or is skipped, counted and warned about (skip)."""
    streams: PositiveInt = 64
    """Logical data streams, fixed when a run starts (recorded in checkpoints): the rows of every step are the
    same on any data-parallel ranks x workers dividing it (64: power-of-two layouts up to 64 readers, e.g.
    8 nodes x 8 GPUs; each rank keeps streams/ranks shards open, so not more than needed)."""
    retries: NonNegativeInt = 5
    """Remote shards (http(s)://, s3://, gs://): retries of a failed read (waiting 1, 2, 4, ... s) before
    the shard is named in the error (or skipped under on_corrupt=skip)."""


@settings(frozen=True, config=SETTINGS)
class ObjectiveArgs:
    """Options of the objectives; each objective reads its own fields (the run config's ``objective_args``)."""

    mask_prob: Fraction = 0.15
    """masked_lm: fraction of non-special tokens selected for prediction."""
    mask_token_prob: Fraction = 0.8
    """masked_lm: of the selected tokens, fraction replaced by the mask token."""
    random_token_prob: Fraction = 0.1
    """masked_lm: of the selected tokens, fraction replaced by a random token (the rest stay unchanged)."""
    prefix_min: Fraction = 0.1
    """prefix_lm: smallest prefix as a fraction of the sequence."""
    prefix_max: Fraction = 0.9
    """prefix_lm: largest prefix as a fraction of the sequence."""
    noise_density: Fraction = 0.15
    """span_corruption: fraction of tokens corrupted."""
    mean_noise_span_length: Annotated[float, Field(ge=1.0)] = 3.0
    """span_corruption: mean length of a corrupted span."""

    def __post_init__(self) -> None:
        if self.mask_token_prob + self.random_token_prob > 1.0:
            raise DataError(
                f"mask_token_prob + random_token_prob must be <= 1, got {self.mask_token_prob} + "
                f"{self.random_token_prob}"
            )
        if self.prefix_min > self.prefix_max:
            raise DataError(f"prefix_min must be <= prefix_max, got {self.prefix_min}, {self.prefix_max}")
