"""The data pipeline's own settings, which the run config composes (``objective_args``): typed, range-checked
and documented field by field here, so that nothing mirrors them."""

from __future__ import annotations

from typing import Annotated

from pydantic import ConfigDict, Field
from pydantic.dataclasses import dataclass as settings

from data_pipeline import DataError

Fraction = Annotated[float, Field(ge=0.0, le=1.0)]


@settings(frozen=True, config=ConfigDict(extra="forbid", use_attribute_docstrings=True, allow_inf_nan=False))
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
