"""Every shipped config lays out its batch as shipped, on one rank and on the README's 8, and `plan` says when it
plans another batch than the config's (tests/e2e/test_shipped_configs_train.py trains each one a step)."""

from __future__ import annotations

import pytest

from megatransformer.commands.plan import batch_note
from megatransformer.config import load_config, shipped_configs
from megatransformer.training.runtime.layout import data_parallel_size, resolve_batch_sizes


@pytest.mark.parametrize("name", sorted(shipped_configs()))
@pytest.mark.parametrize("world", [1, 2, 8])
def test_a_shipped_config_lays_out_its_batch(name, world):
    cfg = load_config(name)
    sizes = resolve_batch_sizes(cfg.train, data_parallel_size(cfg, world))
    assert sizes.global_batch == (cfg.train.global_batch_size or sizes.global_batch)
    assert batch_note(cfg, world) is None


def test_plan_says_when_it_replaces_the_configs_batch():
    cfg = load_config("transformer-base", ["train.micro_batch_size=null", "train.global_batch_size=100"])
    note = batch_note(cfg, 8)
    assert note.startswith("note: the config's batch does not work on 8 ranks (set two of train.micro_batch_size")
    assert "planning global batch 8 (micro 1 x accum 1 x dp 8) instead" in note and "\n" not in note
    odd = load_config("transformer-base", ["train.global_batch_size=100"])
    assert "train.global_batch_size=100 is not divisible" in batch_note(odd, 8)
