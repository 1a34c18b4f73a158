"""Beam search through the CLI: ``megatransformer generate --num-beams`` against transformers on the same
checkpoint exported with ``megatransformer export --format hf``."""

from __future__ import annotations

import pytest
import torch
from support.models import llama_model
from support.runs import cli

transformers = pytest.importorskip("transformers")


def test_generate_cli_beam_search_equals_transformers(tmp_path, tiny_data):
    """``megatransformer generate --num-beams 4 --length-penalty-form hf`` on a checkpoint, against
    transformers on its ``export --format hf``."""
    from data_pipeline.settings import DataSettings
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.checkpoint import write_weights_checkpoint
    from megatransformer.config import RunConfig

    cfg, ours, _ = llama_model(seed=1)
    ckpt = tmp_path / "ckpt"
    write_weights_checkpoint(
        ckpt, RunConfig(model=cfg, data=DataSettings(seq_len=64)), ours.state_dict(), tiny_data.tokenizer
    )
    cli("export", "--checkpoint", ckpt, "--format", "hf", "--out", tmp_path / "hf")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tok = load_tokenizer(tiny_data.tokenizer)
    prompt = "def read_file(path):"
    ids = torch.tensor([tok.encode(prompt)])
    out = theirs.generate(
        ids, num_beams=4, length_penalty=1.0, early_stopping=True, do_sample=False, max_new_tokens=20
    )[0, ids.shape[1] :].tolist()
    expected = prompt + tok.decode(out, skip_special=True)
    got = cli(
        "generate",
        "--checkpoint",
        ckpt,
        "--prompt",
        prompt,
        "--num-beams",
        "4",
        "--length-penalty-form",
        "hf",
        "--length-penalty",
        "1.0",
        "--max-new-tokens",
        "20",
    ).stdout
    assert got == expected + "\n"
