"""Commands whose work takes seconds (tens of them on a busy machine) say what they do before they start it."""

from __future__ import annotations

import pytest
import torch
from support.models import run_config

from megatransformer.checkpoint import write_weights_checkpoint
from megatransformer.cli import main
from megatransformer.model import build_model


@pytest.fixture(scope="module")
def checkpoint(tiny_data, tok, tmp_path_factory):
    cfg = run_config(model=dict(d_model=32, n_layers=1, n_heads=4, d_ff=64, vocab_size=tok.vocab_size, max_seq_len=64))
    torch.manual_seed(0)
    out = tmp_path_factory.mktemp("first_lines") / "ckpt"
    return write_weights_checkpoint(out, cfg, build_model(cfg.model).state_dict(), tiny_data.tokenizer)


def test_generate_says_it_loads_before_it_does_on_stderr(checkpoint, capsys):
    assert main(["generate", "--checkpoint", str(checkpoint), "--prompt", "The", "--max-new-tokens", "2"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == f"loading {checkpoint}" and out.startswith("The")


def test_eval_says_it_loads_before_it_does(checkpoint, tiny_data, capsys):
    data = ["--data", str(tiny_data.shards), "--max-batches", "1", "data.seq_len=32"]
    assert main(["eval", "--checkpoint", str(checkpoint), *data]) == 0
    assert capsys.readouterr().err.splitlines()[0] == f"loading {checkpoint}"


def test_data_tokenizer_says_what_it_reads_first(tiny_data, tmp_path, capsys):
    out = tmp_path / "tokenizer.json"
    assert main(["data", "tokenizer", "--input", str(tiny_data.corpus), "--vocab-size", "512", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "training a 512-token tokenizer on 1 file(s): reading every document"
    assert lines[-1].startswith(f"wrote {out}")


def test_info_says_what_it_loads_then_its_summary_first_and_the_config_last(capsys):
    assert main(["info", "--config", "quickstart"]) == 0
    out, err = capsys.readouterr()
    assert err.splitlines()[0] == "info: runs/quickstart: counting parameters and FLOPs (loading PyTorch)"
    lines = out.splitlines()
    assert lines[0].startswith("parameters:")
    config = lines.index("--- the config, every default filled in:")
    assert config > 2 and "run_dir: runs/quickstart" in lines[config + 1 :]


def test_plan_and_data_shard_say_what_they_do_first(tiny_data, tmp_path, capsys):
    assert main(["plan", "--config", "quickstart", "--gpu", "H100", "--top", "1"]) == 0
    assert capsys.readouterr().err.splitlines()[0] == "plan: runs/quickstart: loading PyTorch, then ranking layouts"
    out = tmp_path / "shards"
    shard = ["data", "shard", "--input", str(tiny_data.corpus), "--tokenizer", str(tiny_data.tokenizer)]
    assert main([*shard, "--out", str(out), "--workers", "1"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == f"sharding 1 file(s) with {tiny_data.tokenizer} into {out}"


def test_data_tokenizer_shows_a_byte_bar_and_says_when_it_computes_the_merges(tiny_data, tmp_path, capsys):
    from data_pipeline.tokenizer import train_tokenizer

    train_tokenizer([str(tiny_data.corpus)], 512, tmp_path / "tokenizer.json", progress=True)
    err = capsys.readouterr().err
    assert "reading: 100%" in err and err.rstrip().splitlines()[-1].endswith("documents: computing the merges")
