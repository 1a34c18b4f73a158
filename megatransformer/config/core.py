"""The core every section builds on: :class:`Section` (unknown keys, NaN and booleans-as-numbers refused),
:class:`ConfigError`, and the ranges of the schema's values."""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic.fields import FieldInfo
from pydantic_core import PydanticCustomError


class ConfigError(ValueError):
    """A configuration or command-line value is wrong; the message says which and how to fix it."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, docstrings document fields, no float may be
    NaN or infinite (a NaN passes every ``<``/``>`` range check, then trains to NaN), and no number may be a
    boolean (pydantic reads ``optim.lr=true`` as 1.0)."""

    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, validate_assignment=True, allow_inf_nan=False
    )

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        values = value if isinstance(value, (list, tuple)) else [value]
        field = cls.model_fields[info.field_name]
        number = _admits(field, _number_type) and not _admits(field, _boolean_type)
        if number and any(isinstance(v, bool) for v in values):
            raise PydanticCustomError(BOOLEAN_NUMBER, "a boolean where a number is meant")
        return value


def _boolean_type(annotation: Any) -> bool:
    return annotation is bool or annotation is Any or isinstance(annotation, bool)


def _number_type(annotation: Any) -> bool:
    return annotation in (int, float) or (isinstance(annotation, (int, float)) and not isinstance(annotation, bool))


def _admits(field: FieldInfo, kind: Callable[[Any], bool]) -> bool:
    """Whether a field's annotation admits a value of ``kind`` anywhere (in a union, a list, a ``Literal``)."""

    def admits(annotation: Any) -> bool:
        return kind(annotation) or any(admits(arg) for arg in typing.get_args(annotation))

    return admits(field.annotation)


# Ranges of the schema's values: one out of range is refused with a line naming the key and the value.
Fraction = Annotated[float, Field(ge=0.0, lt=1.0)]
"""A probability that must leave something over: dropout, label smoothing, Adam betas."""
UnitInterval = Annotated[float, Field(ge=0.0, le=1.0)]
"""A fraction of a whole, both ends included."""
MAX_VOCAB = 1 << 22
"""Largest model.vocab_size accepted: the largest vocabularies in use hold about 256k tokens (Gemma's
262,144); 2**22 leaves 16x headroom and still refuses a typo such as 1e9, whose embedding table alone would
need terabytes (the run would die allocating it, with a traceback)."""
MAX_LAYERS = 1 << 12
"""Largest model.n_layers and n_decoder_layers accepted: models in use have up to about 130 blocks and the
deepest trained (DeepNet) 1,000; 4,096 leaves room and refuses a typo such as 10**6."""
MAX_WIDTH = 1 << 20
"""Largest model.d_model and d_ff accepted: the widest in use are about 25k (d_model) and 74k (PaLM's d_ff)."""
MAX_SEQ_LEN = 1 << 24
"""Largest model.max_seq_len accepted: the longest contexts in use hold about 10M tokens."""
MIN_LR = 1e-10
"""Smallest optim.lr accepted: fine-tuning rates go down to about 1e-7; a rate of 1e-10 moves a weight of 0.02 by
one part in a few hundred million a step, below fp32's resolution, so anything smaller (a typo such as 3e-40, or
5e-324) would train nothing while looking like a run."""
MAX_LR = 10.0
"""Largest optim.lr and optim.muon_lr accepted: Adam's rates lie below about 1e-2, Muon's below about 0.1, and the
inverse_sqrt schedule's multiplier is about 1 (the 2017 paper); a rate above 10 (a typo such as 3e4, or 1e10) kills
the model in a step or two: its gradients vanish and its output turns uniform (DeadRun in
training/observability/spikes.py stops such a run, but only after train.max_dead_steps steps)."""
MAX_STEPS = 10**9
"""Largest train.max_steps accepted: the longest published pretraining runs take a few million optimizer steps;
a billion is decades at ten steps a second, and still refuses a typo such as 1e30."""


BOOLEAN_NUMBER = "boolean_number"
"""The error of a boolean given where a number is meant (:class:`Section`)."""
