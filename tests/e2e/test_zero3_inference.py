"""``generate`` and ``eval --data`` / ``--bleu`` with ``--zero-stage 3`` on two ranks, each holding half of the model:
the text, the numbers and the translations of one process holding all of it, printed once."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from support.runs import CLI, ONE_THREAD, TINY_MODEL, cli, torchrun

PROMPT = "Return the"


@pytest.fixture(scope="module")
def saved(tiny_data, tmp_path_factory) -> dict[str, Path]:
    """Weights checkpoints of a random decoder (the tiny one of the training tests, large initial weights: peaked
    distributions) and of a random one-layer encoder-decoder, with tiny_data's tokenizer; three translation pairs."""
    from megatransformer.checkpoint import write_weights_checkpoint
    from megatransformer.config import RunConfig
    from megatransformer.model import build_model

    root = tmp_path_factory.mktemp("zero3_inference")
    models = {
        "decoder": {"model": TINY_MODEL | {"init_std": 0.2}, "data": {"seq_len": 64}},
        "encoder_decoder": {
            "model": TINY_MODEL | {"arch": "encoder_decoder", "n_layers": 1, "max_seq_len": 32, "init_std": 0.2},
            "data": {"seq_len": 32},
            "objective": "prefix_lm",
        },
    }
    saved = {}
    for name, sections in models.items():
        cfg = RunConfig.model_validate(sections)
        torch.manual_seed(0)
        state = build_model(cfg.model).state_dict()
        saved[name] = write_weights_checkpoint(root / name, cfg, state, tiny_data.tokenizer)
    pairs = [("Return the value of", "the value"), ("Create a new", "a new one"), ("If the file", "the file is")]
    saved["pairs"] = root / "pairs.jsonl"
    saved["pairs"].write_text("".join(json.dumps({"src": s, "tgt": t}) + "\n" for s, t in pairs))
    return saved


def two_ranks(*args: object) -> subprocess.CompletedProcess:
    """``megatransformer ARGS --zero-stage 3`` on two torchrun ranks (a hang fails at the timeout)."""
    command = [*torchrun(2), *CLI[1:], *map(str, args), "--zero-stage", "3"]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **ONE_THREAD}, timeout=300)
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stderr[-4000:]}"
    return result


@pytest.mark.parametrize(
    "decoding",
    [
        ("--temperature", "1.0", "--top-k", "50", "--seed", "3", "--max-new-tokens", "24"),
        ("--num-beams", "3", "--max-new-tokens", "8"),
    ],
    ids=["sampled", "beams"],
)
def test_generate_at_zero3_prints_the_text_of_one_process_once(saved, decoding):
    """Each step takes rank 0's token (beam search: its ranked candidates), so both ranks run as many forwards and
    stop together; rank 0 alone prints."""
    args = ("generate", "--checkpoint", saved["decoder"], "--prompt", PROMPT, *decoding)
    one = cli(*args, env=ONE_THREAD).stdout
    two = two_ranks(*args)
    assert one.startswith(PROMPT) and len(one) > len(PROMPT) + 1
    assert two.stdout == one
    assert two.stderr.count("loading ") == 1


def test_eval_data_at_zero3_gives_the_numbers_of_one_process(saved, tiny_data):
    """Five batches of the validation split: rank 0 runs three, rank 1 two and then a stand-in forward while rank
    0 runs its third. Counts equal; the loss and the figures made from it within 1e-6 relative (the batches' sums
    are added in the one-process order: here they are equal to the bit)."""
    args = ("eval", "--checkpoint", saved["decoder"], "--data", tiny_data.shards, "--batch-size", 4)
    args += ("--max-batches", 5, "--json")
    one = json.loads(cli(*args, env=ONE_THREAD).stdout)
    result = two_ranks(*args)
    two = json.loads(result.stdout)
    assert one["sequences"] == 20 and one["tokens"] > 0
    for key in ("checkpoint", "objective", "tokens", "bytes", "words", "sequences"):
        assert two[key] == one[key], key
    for key in ("loss", "perplexity", "bits_per_byte", "word_perplexity"):
        assert two[key] == pytest.approx(one[key], rel=1e-6), key
    assert "ZeRO-3 over 2 ranks: 1/2 of the weights a rank" in result.stderr
    assert result.stderr.count("evaluating ") == 1


def test_eval_bleu_at_zero3_translates_as_one_process(saved, tmp_path):
    """An encoder-decoder (its encoder and decoder called apart): every rank translates every sentence taking rank
    0's beam choices; rank 0 writes the hypotheses and prints the scores."""
    args = ("eval", "--checkpoint", saved["encoder_decoder"], "--data", saved["pairs"], "--source-field", "src")
    args += ("--target-field", "tgt", "--bleu", "--num-beams", "2", "--batch-size", "2", "--json")
    one = json.loads(cli(*args, "--hypotheses", tmp_path / "one.txt", env=ONE_THREAD).stdout)
    two = json.loads(two_ranks(*args, "--hypotheses", tmp_path / "two.txt").stdout)
    assert (tmp_path / "two.txt").read_text() == (tmp_path / "one.txt").read_text()
    assert two == one and one["sentences"] == 3
