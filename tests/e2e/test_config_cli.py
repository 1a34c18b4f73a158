"""Configs through the real command line: `megatransformer info` on every shipped config, and refusals with
exit code 2 and one line, before DeepSpeed starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support import REPO, assert_one_line
from support.runs import cli, tiny_data_overrides, tiny_model, train

from megatransformer.config import load_config

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
QUICKSTART = REPO / "configs" / "quickstart.yaml"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_info_works_for_every_shipped_config(path):
    result = cli("info", "--config", path, "--json", check=False)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["params"] > info["non_embedding_params"] > 0
    positions_per_token = 2 if info["config"]["model"]["arch"] == "encoder_decoder" else 1
    assert info["flops_per_token"] > 6 * info["non_embedding_params"] / positions_per_token
    assert info["config"]["model"] == load_config(path).model.model_dump(mode="json")


def test_cli_bad_config_exits_2_with_one_line_and_no_traceback():
    result = cli("info", "--config", QUICKSTART, "model.n_kv_heads=3", check=False)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "n_kv_heads=3" in result.stderr


# ------------------------------------------------------------------ availability: a real `megatransformer train`

TINY = [
    *tiny_model(),
    "data.seq_len=64",
    "train.micro_batch_size=4",
    "train.grad_accum=1",
    "train.max_steps=2",
    "wandb.mode=disabled",
]


@pytest.fixture(scope="module")
def other_tokenizer(tiny_data, tmp_path_factory) -> Path:
    """A tokenizer of the same corpus with another vocabulary: not the one the shards were made with."""
    from data_pipeline.tokenizer import train_tokenizer

    path = tmp_path_factory.mktemp("other_tokenizer") / "tokenizer.json"
    train_tokenizer([str(tiny_data.corpus)], 400, path)
    return path


@pytest.mark.parametrize("case", ["flash", "flex", "fp16", "tokenizer_vs_shards", "tokenizer_vs_vocab"])
def test_unusable_on_this_machine_fails_before_deepspeed_without_run_dir(case, tiny_data, other_tokenizer, tmp_path):
    import torch

    if torch.cuda.is_available() and case in ("flash", "flex", "fp16"):
        pytest.skip("these are refused on machines without CUDA only")
    extra, key = {
        "flash": (["model.attention_backend=flash"], "model.attention_backend=flash needs a CUDA GPU"),
        "flex": (["model.attention_backend=flex"], "model.attention_backend=flex cannot train on CPU"),
        "fp16": (["precision=fp16"], "precision=fp16 needs a GPU"),
        "tokenizer_vs_shards": ([f"data.tokenizer={other_tokenizer}"], "another tokenizer than data.tokenizer="),
        "tokenizer_vs_vocab": (["model.vocab_size=256"], "model.vocab_size=256"),
    }[case]
    run = tmp_path / "run"
    overrides = [*tiny_data_overrides(tiny_data), *TINY, f"run_dir={run}"]
    result = train(overrides + extra, expect=None, env={"DS_ACCELERATOR": "cpu"})
    assert result.returncode == 2, result.stderr[-3000:]
    assert_one_line(result.stderr, "megatransformer train: error:", key)
    # nothing from DeepSpeed's start-up, it never started: only the run's first line
    assert result.stdout == f"training {run} to step 2: starting PyTorch and DeepSpeed\n"
    assert not run.exists()
