"""Every shipped config trains as shipped: its batch, objective, precision, optimizer and schedule, one step of a
model shrunk in size only, on the tiny corpus (one process a config)."""

from __future__ import annotations

import pytest
from support.runs import ONE_THREAD, cli

from megatransformer.config import load_config, shipped_configs

# sizes only: the width, depth, vocabulary and sequence length (n_heads 4: llama-style's n_kv_heads divides it)
SMALL = ["model.d_model=32", "model.n_layers=1", "model.n_heads=4", "model.d_ff=64", "model.vocab_size=512"]
SMALL += ["model.max_seq_len=64", "data.seq_len=32"]


@pytest.mark.parametrize("name", sorted(shipped_configs()))
def test_a_shipped_config_trains_as_shipped(name, tiny_data, tmp_path):
    run = tmp_path / name
    overrides = [*SMALL, "train.max_steps=1", f"run_dir={run}", "wandb.mode=disabled"]
    overrides += [f"data.train={tiny_data.shards}", f"data.tokenizer={tiny_data.tokenizer}"]
    result = cli("train", "--config", name, *overrides, env=ONE_THREAD)
    assert "done: 1 of 1 steps" in result.stdout, result.stdout[-2000:]
    saved = load_config(run / "config.yaml").train  # (the batch the run took: the shipped one)
    shipped = load_config(name).train
    assert (saved.micro_batch_size, saved.grad_accum, saved.global_batch_size) == (
        shipped.micro_batch_size,
        shipped.grad_accum,
        shipped.global_batch_size,
    )
