"""ALiBi trained: tensor parallelism 2 equals one rank, a model trained at length 128 evaluates and generates
beyond it, and export to ``transformers`` refuses it by name. Real `megatransformer train` runs."""

from __future__ import annotations

import io
import json
import math
import sys

import pytest
import torch
from support.runs import losses, metrics, tiny_run, train


@pytest.fixture(scope="module")
def alibi_runs(tiny_data, tmp_path_factory):
    """The same tiny ALiBi decoder trained at length 128 on one rank and with tensor_parallel=2 (two ranks)."""
    root = tmp_path_factory.mktemp("alibi")
    runs = {"tp1": root / "tp1", "tp2": root / "tp2"}
    extra = ["model.position=alibi", "data.seq_len=128", "train.grad_accum=1", "parallel.zero_stage=1"]
    train(tiny_run(tiny_data, runs["tp2"], steps=4) + extra + ["parallel.tensor_parallel=2"], nproc=2)
    train(tiny_run(tiny_data, runs["tp1"], steps=4) + extra)
    return runs


def test_tensor_parallel_alibi_equals_single_rank(alibi_runs):
    assert len(losses(alibi_runs["tp1"])) == 4
    assert losses(alibi_runs["tp2"]) == pytest.approx(losses(alibi_runs["tp1"]), rel=1e-5)
    grads = [[r["grad_norm"] for r in metrics(run) if "grad_norm" in r] for run in alibi_runs.values()]
    assert grads[0] == pytest.approx(grads[1], rel=1e-4)


def test_a_model_trained_at_128_evaluates_at_256(alibi_runs, tiny_data):
    from megatransformer.cli import main
    from megatransformer.inference import load_for_inference

    run = alibi_runs["tp1"]
    # the eval command, on sequences of twice the training length (max_seq_len is 128)
    with pytest.MonkeyPatch.context() as patch:
        out = io.StringIO()
        patch.setattr(sys, "stdout", out)
        assert (
            main(
                [
                    "eval",
                    "--checkpoint",
                    str(run),
                    "--data",
                    str(tiny_data.shards),
                    "--max-batches",
                    "2",
                    "--json",
                    "data.seq_len=256",
                ]
            )
            == 0
        )
    result = json.loads(out.getvalue())
    assert math.isfinite(result["loss"]) and result["tokens"] > 2 * 8 * 128
    # the model directly: one 256-token stretch of text, positions 0..255
    loaded = load_for_inference(str(run))
    ids = torch.tensor([loaded.tokenizer.encode(tiny_data.corpus.read_text()[:20_000])[:257]])
    with torch.no_grad():
        logits = loaded.model(ids[:, :-1])
    token_losses = torch.nn.functional.cross_entropy(logits[0], ids[0, 1:], reduction="none")
    assert logits.shape[1] == 256 and torch.isfinite(token_losses).all()
    assert token_losses[128:].mean() < math.log(512)  # better than uniform beyond the trained length


def test_export_as_hf_refuses_alibi_by_name(alibi_runs, tmp_path, capsys):
    from megatransformer.cli import main

    assert (
        main(["export", "--checkpoint", str(alibi_runs["tp1"]), "--format", "hf", "--out", str(tmp_path / "hf")]) == 2
    )
    assert "model.position=alibi (Llama needs rope)" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()


def test_generate_goes_past_max_seq_len(alibi_runs, capsys):
    """max_seq_len (128) sizes no table with ALiBi: `generate` may write 200 tokens after the prompt."""
    from megatransformer.cli import main

    assert (
        main(
            [
                "generate",
                "--checkpoint",
                str(alibi_runs["tp1"]),
                "--prompt",
                "Return the",
                "--max-new-tokens",
                "200",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    assert capsys.readouterr().out.startswith("Return the")
