"""What a user reads and types: command-line parsing, help texts, configs by name, the training console and its
closing summary, plot placement, tokenizer size notes (issue 16)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from megatransformer.cli import build_parser, main, parse_args
from megatransformer.config import ConfigError, load_config, shipped_configs

# ---------------------------------------------------------------------------------------- parsing, help


def test_an_override_after_a_list_option_is_an_override_not_a_path():
    args = parse_args(build_parser(), ["eval", "--checkpoint", "runs/q", "--data", "a.txt", "b.txt",
                                       "data.seq_len=64", "--batch-size", "2", "data.pack=false"])
    assert args.data == ["a.txt", "b.txt"]
    assert args.overrides == ["data.seq_len=64", "data.pack=false"]
    assert args.batch_size == 2


def test_overrides_keep_their_order_wherever_they_come():
    args = parse_args(build_parser(), ["info", "seed=1", "--config", "quickstart", "--json", "seed=2"])
    assert args.overrides == ["seed=1", "seed=2"] and args.json  # the last one wins, as written


def test_a_word_that_is_not_an_override_is_still_an_error(capsys):
    assert main(["info", "--config", "quickstart", "--json", "stray"]) == 2
    assert "override 'stray' is not of the form key.path=value" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        parse_args(build_parser(), ["info", "--config", "quickstart", "seed=1", "--json", "stray"])
    assert exit_.value.code == 2 and "unrecognized arguments: stray" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:  # --data needs a path, not only an override
        parse_args(build_parser(), ["eval", "--checkpoint", "x", "--data", "data.seq_len=64"])
    assert exit_.value.code == 2 and "--data needs a value" in capsys.readouterr().err


def test_commands_without_overrides_keep_argparse_rules():
    args = parse_args(build_parser(), ["data", "shard", "--input", "seed=1.txt", "--tokenizer", "t", "--out", "o"])
    assert args.input == ["seed=1.txt"]  # shard takes no overrides: a file name with '=' stays a file


def test_help_shows_defaults_and_a_description(capsys):
    for argv in (["--help"], ["generate", "--help"], ["data", "shard", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
    out = " ".join(capsys.readouterr().out.split())  # (help is wrapped to the terminal's width)
    assert "Pretrain Transformer language models" in out and "registered from a table" not in out
    assert "(default: 1)" in out and "(default: 0.8)" in out  # generate's --num-beams, --temperature
    assert "(default: 256.0)" in out  # shard's --shard-mb
    assert "(default: None)" not in out  # unset defaults say nothing


# ------------------------------------------------------------------------------------------- configs


def test_configs_are_addressable_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {"quickstart", "llama-style", "transformer-base"} <= set(shipped_configs())
    assert load_config("llama-style").model.d_model == 768
    assert load_config("quickstart.yaml", ["seed=3"]).seed == 3
    with pytest.raises(ConfigError, match="does not exist; give a YAML path or the name of a shipped config "
                                          r"\(bert-style, llama-style"):
        load_config("lama-style")
    local = tmp_path / "llama-style"  # an existing file wins over a shipped name
    local.write_text("seed: 7\n")
    assert load_config("llama-style").seed == 7


# ------------------------------------------------------------------------------------------- console


def test_quiet_engine_holds_back_start_up_chatter(capsys):
    from megatransformer.commands.train import quiet_engine

    with quiet_engine(verbose=False):
        print("DeepSpeed deepspeed_shm_comm_op built successfully")
    with quiet_engine(verbose=True):
        print("shown with --verbose")
    with pytest.raises(RuntimeError), quiet_engine(verbose=False):
        print("context of a failure")
        raise RuntimeError("start-up failed")
    out, err = capsys.readouterr()
    assert "built successfully" not in out + err
    assert "shown with --verbose" in out and "context of a failure" in err


def test_a_sample_is_cut_at_its_first_blank_line():
    from megatransformer.commands.train import format_sample

    assert format_sample("The function", " returns\n\n\n\n\n\n") == "sample: The function returns"
    assert format_sample("The", " a\nb\n\nc") == "sample: The a\nb"


@pytest.fixture(scope="module")
def short_run(tiny_data, tmp_path_factory):
    """A four-step run through the real CLI: logs every 2 steps, validates at step 3 and at the end."""
    run = tmp_path_factory.mktemp("console") / "run"
    overrides = ["model.d_model=64", "model.n_layers=1", "model.n_heads=4", "model.d_ff=96", "model.vocab_size=512",
                 "model.max_seq_len=64", f"run_dir={run}", f"data.train={tiny_data.shards}",
                 f"data.tokenizer={tiny_data.tokenizer}", "data.seq_len=32", "train.micro_batch_size=2",
                 "train.grad_accum=1", "train.max_steps=4", "train.log_every=2", "train.eval_every=3",
                 "train.eval_batches=1", "train.sample_prompt=The function", "wandb.mode=disabled"]
    result = subprocess.run([sys.executable, "-m", "megatransformer.cli", "train", "--config", os.devnull,
                             *overrides], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return run, result.stdout, records


@pytest.mark.slow
def test_console_shows_the_numbers_of_metrics_jsonl(short_run):
    run, out, records = short_run
    lines = re.findall(r"^step (\d+)/4 \| loss (\S+) \| lr (\S+) \| ([\d,]+) tok/s \| MFU ([\d.]+)% \| ETA \S+$",
                       out, re.M)
    train = [r for r in records if "loss" in r]
    assert [int(step) for step, *_ in lines] == [r["step"] for r in train] == [2, 4]
    for (step, loss, lr, speed, mfu), record in zip(lines, train):
        assert loss == f"{record['loss']:.4f}" and float(lr) == pytest.approx(record["lr"], rel=1e-2)
        assert speed == f"{record['tokens_per_s']:,.0f}" and mfu == f"{100 * record['mfu']:.2f}"
    valid = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in valid] == [3, 4]
    for record in valid:
        assert f"step {record['step']}: validation loss {record['val_loss']:.4f}" in out
    assert "built successfully" not in out


@pytest.mark.slow
def test_a_run_ends_with_a_summary_and_the_next_commands(short_run):
    run, out, records = short_run
    summary = out[out.index("done: "):]
    last = [r for r in records if "loss" in r][-1]
    assert summary.startswith(f"done: 4 of 4 steps, {last['tokens']:,} tokens, wall time ")
    assert f"final train loss       {last['loss']:.4f}" in summary
    assert f"final validation loss  {records[-1]['val_loss']:.4f}" in summary
    assert f"checkpoint:            {run}/checkpoints/step_000004" in summary
    assert f"metrics:               {run}/metrics.jsonl" in summary
    assert f"plot:                  {run}/metrics.png" in summary
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert f"megatransformer eval --checkpoint {run} --data " in summary
    assert f"megatransformer generate --checkpoint {run} --prompt 'The function'" in summary
    assert f"megatransformer export --checkpoint {run} --format hf --out {run}/hf" in summary
    sample = out[out.index("sample: "):out.index("done: ")]
    assert "\n\n" not in sample.rstrip("\n") + "\n"  # cut at its first blank line


@pytest.mark.slow
def test_plot_writes_next_to_the_run(short_run, tmp_path, monkeypatch, capsys):
    run, _, _ = short_run
    (run / "metrics.png").unlink()
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(run)]) == 0
    assert (run / "metrics.png").is_file() and not list(tmp_path.iterdir())
    other = run.parent / "other"
    other.mkdir()
    (other / "metrics.jsonl").write_text((run / "metrics.jsonl").read_text())
    assert main(["plot", str(run), str(other)]) == 0
    assert (run.parent / "compare.png").is_file()
    assert f"wrote {run.parent / 'compare.png'}" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------- tokenizer


def test_the_tokenizer_says_when_it_is_smaller_than_asked(tmp_path, capsys):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("a small corpus\n\nwith few words\n")
    assert main(["data", "tokenizer", "--input", str(corpus), "--vocab-size", "2000", "--out",
                 str(tmp_path / "tok.json")]) == 0
    out, err = capsys.readouterr()
    size = int(re.search(r"has ([\d,]+) tokens, fewer than the 2,000 asked", err)[1].replace(",", ""))
    assert size < 2000 and f"{size} tokens of 2000 asked" in out
