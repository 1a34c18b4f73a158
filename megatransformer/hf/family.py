"""The table machinery every family shares: a :class:`Family` of both sides' fields, the keys no family
carries, and the helpers of their weight-name tables."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from megatransformer.config import ModelConfig, validate

# transformers config keys that change nothing a forward pass computes: initialisation, caching, token ids.
IGNORED_KEYS = ("initializer_range", "use_cache", "pad_token_id", "bos_token_id", "eos_token_id")
# Tensors older transformers saved that are buffers, not weights: never carried, never refused.
_BUFFERS = re.compile(r"(\.rotary_emb\.inv_freq|\.attn\.(masked_)?bias)$")


class Neutral(NamedTuple):
    """A transformers config key we do not carry: its default (when the key is absent) and the values under
    which it changes nothing. Any other value is refused."""

    default: Any
    values: tuple


# the activation ACT2FN runs for these names is SiLU
SILU = Neutral("silu", ("silu", "swish"))


@dataclass(frozen=True, eq=False)  # (a family is itself: compared and hashed by identity)
class Family:
    """One ``transformers`` class our decoder maps onto exactly, as tables of both sides' fields.

    Export: ``requires`` names our config fields the class fixes and the value it needs (a callable of the config
    for a relation); ``config`` maps the others (but checkpoint.HOW_NOT_WHAT, which change nothing computed);
    ``not_carried`` are our fields that act only in training mode and have no place in the class (exported with
    a note). Import: ``model_config`` maps the keys of ``mapped``; ``neutral`` holds those it cannot carry;
    ``ignored`` (and ``IGNORED_KEYS``) change nothing the class computes; ``weight_options`` reads from a
    ``config.json`` the keyword arguments ``from_hf`` needs besides (DeepSeek's RoPE layout).
    tests/unit/test_hf_fields.py checks that every field of our config and of transformers' config class is in one
    of these tables.
    """

    name: str
    model_type: str
    architecture: str
    requires: dict[str, Any]
    config: Callable[[ModelConfig], dict]
    to_hf: Callable[[dict, ModelConfig], dict]
    from_hf: Callable[[dict, ModelConfig], dict]
    model_config: Callable[[dict], ModelConfig]
    mapped: tuple[str, ...]
    neutral: dict[str, Neutral] = field(default_factory=dict)
    ignored: tuple[str, ...] = ()
    not_carried: tuple[str, ...] = ()
    weight_options: Callable[[dict], dict] = lambda hf: {}

    def incompatibility(self, cfg: ModelConfig) -> str | None:
        """Why ``cfg`` cannot be this class, or None when it can."""
        for name, needed in self.requires.items():
            needed = needed(cfg) if callable(needed) else needed
            if getattr(cfg, name) != needed:
                return f"model.{name}={getattr(cfg, name)} ({self.name} needs {needed})"
        return None

    def refusal(self, hf: dict) -> str | None:
        """Why a ``config.json`` of this class cannot be ours (a key we cannot carry), or None."""
        for key, neutral in self.neutral.items():
            value = hf.get(key, neutral.default)
            if value not in neutral.values:
                supported = " or ".join(repr(v) for v in neutral.values)
                return f"{self.name} {key}={value!r} is not supported (only {supported})"
        return None

    def notes(self, cfg: ModelConfig) -> list[str]:
        """Our training-only settings this class has no place for (the exported model then computes the same in
        evaluation mode, not in training mode)."""
        return [
            f"model.{name}={getattr(cfg, name)} is not carried: {self.architecture} has no such dropout"
            for name in self.not_carried
            if getattr(cfg, name)
        ]


def build_config(**fields: Any) -> ModelConfig:
    """Our ModelConfig from mapped fields; a value it refuses is one line (ConfigError, a ValueError)."""
    return validate(fields, ModelConfig)


def check_leftovers(state: dict[str, torch.Tensor], used: set[str], family: str) -> None:
    """Tensors of a checkpoint that no mapped weight takes (a bias, an extra layer) are refused, not dropped."""
    leftover = sorted(name for name in state if name not in used and not _BUFFERS.search(name))
    if leftover:
        raise ValueError(
            f"{family} checkpoint holds {len(leftover)} tensors its config does not describe, e.g. {leftover[0]}"
        )


def check_tied_head(state: dict[str, torch.Tensor], head: str, embedding: str, family: str) -> None:
    """A tied model (tie_word_embeddings) whose file also holds an output head that differs from its embedding is
    refused: transformers 5 then leaves the two untied and reads the file's head (it warns), older versions tie
    the head to the embedding; either reading would give other logits than the other."""
    if head not in state or embedding not in state:
        return
    theirs, tied = state[head], state[embedding]
    if theirs.shape == tied.shape and (theirs.is_meta or tied.is_meta or torch.equal(theirs, tied)):
        return  # (shapes alone are checked here; values where they are read)
    gap = (
        f"by up to {(theirs.float() - tied.float()).abs().max().item():.4g}"
        if theirs.shape == tied.shape
        else "in shape"
    )
    raise ValueError(
        f"{family} checkpoint is tied (config.json: tie_word_embeddings) but holds a {head} that differs from "
        f"{embedding} ({gap}): transformers then reads one or the other by version; remove {head} from the weights "
        "(tied) or set tie_word_embeddings to false in config.json (an untied head, where the family allows one)"
    )


def expand_names(global_names: list, layer_names: list, n_layers: int) -> list[tuple[str, str]]:
    """(ours, theirs) weight names: the global pairs, then the ``{i}`` templates of each layer filled in."""
    pairs = list(global_names)
    for i in range(n_layers):
        pairs += [(ours.format(i=i), theirs.format(i=i)) for ours, theirs in layer_names]
    return pairs
