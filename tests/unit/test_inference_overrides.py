"""eval and generate apply model.* overrides that keep the weights' shapes (a window, a RoPE scaling, a longer
max_seq_len) and refuse every other override in one line; init_from names the model fields it changes."""

from __future__ import annotations

import json

import pytest
import torch

from megatransformer.checkpoint import computation_differences, write_weights_checkpoint
from megatransformer.cli import main
from megatransformer.config import ConfigError, RunConfig
from megatransformer.inference import load_for_inference, with_model_overrides
from megatransformer.model import build_model

MODEL = dict(d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48, vocab_size=512, max_seq_len=32, init_std=0.3)


@pytest.fixture(scope="module")
def checkpoint(tiny_data, tmp_path_factory):
    """A random rope decoder trained (so to speak) at 32 positions, as a weights-only checkpoint (a large init:
    sharp attention, which positions change visibly)."""
    cfg = RunConfig.model_validate({"model": MODEL, "data": {"seq_len": 32, "tokenizer": str(tiny_data.tokenizer)}})
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("overrides") / "ckpt"
    return write_weights_checkpoint(out, cfg, build_model(cfg.model).state_dict(), tiny_data.tokenizer)


def eval_loss(checkpoint, data, capsys, *overrides: str) -> float:
    args = ["eval", "--checkpoint", str(checkpoint), "--data", str(data), "--max-batches", "1", "--json"]
    assert main([*args, *overrides]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["loss"]


def test_eval_applies_a_window_and_a_rope_scaling(checkpoint, tiny_data, capsys):
    shards = tiny_data.shards
    plain = eval_loss(checkpoint, shards, capsys)
    assert eval_loss(checkpoint, shards, capsys, "model.attention_window=32") == plain  # (as wide as the rows)
    assert eval_loss(checkpoint, shards, capsys, "model.attention_window=4") != plain
    assert eval_loss(checkpoint, shards, capsys, "model.rope_scaling={type: linear, factor: 2}") != plain


def test_eval_reaches_dynamic_ntk_beyond_the_trained_length(checkpoint, tiny_data, capsys, tmp_path):
    """Rows of 64 positions of one long document on a model trained at 32: plain RoPE extrapolates, dynamic NTK
    scales from position 32 on."""
    document = tmp_path / "long.txt"  # (no blank line: one document)
    document.write_text(" ".join(tiny_data.corpus.read_text()[:6000].split()))
    longer = ["data.seq_len=64", "model.max_seq_len=64"]
    plain = eval_loss(checkpoint, document, capsys, *longer)
    dynamic = "model.rope_scaling={type: dynamic, factor: 2, original_max_seq_len: 32}"
    assert eval_loss(checkpoint, document, capsys, *longer, dynamic) != plain
    within = "model.rope_scaling={type: dynamic, factor: 2, original_max_seq_len: 64}"  # (scaling from 64 on)
    assert eval_loss(checkpoint, document, capsys, *longer, within) == plain


@pytest.mark.parametrize(
    "override,message",
    [
        ("model.d_model=64", "model.d_model=64 would change the shapes of the checkpoint's weights (model.d_model=32"),
        ("model.dropout=0.1", "model.dropout acts only in training; it would change nothing here"),
        ("train.precision=bf16", "train.precision=bf16 would change nothing in eval"),
        ("data.train=elsewhere", "data.train=elsewhere would change nothing in eval"),
        ("model.attention_window=40", "model.attention_window=40 exceeds model.max_seq_len=32"),
    ],
)
def test_eval_refuses_what_it_cannot_apply_in_one_line(checkpoint, tiny_data, capsys, override, message):
    args = ["eval", "--checkpoint", str(checkpoint), "--data", str(tiny_data.shards), override]
    assert main(args) == 2
    *before, refusal = capsys.readouterr().err.splitlines()  # (what the command does first: loading the model)
    assert message in refusal and all(line.startswith("loading ") for line in before), (before, refusal)


def test_generate_goes_beyond_the_trained_length_with_a_longer_max_seq_len(checkpoint, capsys):
    args = ["generate", "--checkpoint", str(checkpoint), "--prompt", "The", "--max-new-tokens", "40"]
    assert main(args) == 2 and "exceeds what model.max_seq_len=32 leaves" in capsys.readouterr().err
    dynamic = "model.rope_scaling={type: dynamic, factor: 2, original_max_seq_len: 32}"
    assert main([*args, "--temperature", "0", "model.max_seq_len=64", dynamic]) == 0
    assert main([*args, "data.seq_len=64"]) == 2
    assert "only model.* overrides apply to a trained model here" in capsys.readouterr().err


def test_a_learned_position_table_keeps_its_length():
    cfg = RunConfig.model_validate({"model": {**MODEL, "position": "learned"}, "data": {"seq_len": 32}})
    with pytest.raises(ConfigError, match="model.max_seq_len=64 would change the shapes"):
        with_model_overrides(cfg, ["model.max_seq_len=64"])


def test_overrides_reach_the_model_that_runs(checkpoint):
    loaded = load_for_inference(checkpoint, model_overrides=["model.attention_window=4"])
    assert loaded.cfg.model.attention_window == 4 and loaded.model.config.attention_window == 4


def test_init_from_names_the_model_fields_it_changes():
    saved = RunConfig.model_validate({"model": MODEL, "data": {"seq_len": 32}}).model
    now = saved.model_copy(update={"attention_window": 8, "attention_backend": "eager"})
    assert computation_differences(saved, now) == ["model.attention_window=8 (None there)"]
