"""What a user reads and types: command-line parsing, help texts, configs by name, the console's quiet start-up
and samples, tokenizer size notes."""

from __future__ import annotations

import os
import re
import sys

import pytest

from megatransformer.cli import build_parser, main, parse_args
from megatransformer.config import ConfigError, load_config, shipped_configs
from megatransformer.model.transformer import build_shapes

# ---------------------------------------------------------------------------------------- parsing, help


def test_an_override_after_a_list_option_is_an_override_not_a_path():
    args = parse_args(
        build_parser(),
        [
            "eval",
            "--checkpoint",
            "runs/q",
            "--data",
            "a.txt",
            "b.txt",
            "data.seq_len=64",
            "--batch-size",
            "2",
            "data.pack=false",
        ],
    )
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


def test_export_help_names_every_family_it_writes(capsys):
    from megatransformer.hf import FAMILIES

    with pytest.raises(SystemExit):
        main(["export", "--help"])
    description = " ".join(capsys.readouterr().out.split()).split("options:")[0]
    assert all(family.name in description for family in FAMILIES), description


# ------------------------------------------------------------------------------------------- configs


def test_configs_are_addressable_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert {"quickstart", "llama-style", "transformer-base"} <= set(shipped_configs())
    assert load_config("llama-style").model.d_model == 768
    assert load_config("quickstart.yaml", ["seed=3"]).seed == 3
    with pytest.raises(
        ConfigError,
        match="does not exist; give a YAML path or the name of a shipped config "
        r"\(bert-style, llama-style",
    ):
        load_config("lama-style")
    with pytest.raises(
        ConfigError, match=r"configs/transformer-base.yaml does not exist here; .* --config transformer-base$"
    ):
        load_config("configs/transformer-base.yaml")  # (a clone's path, outside a clone)
    local = tmp_path / "llama-style"  # an existing file wins over a shipped name
    local.write_text("seed: 7\n")
    assert load_config("llama-style").seed == 7


# ------------------------------------------------------------------------------------------- console


def test_held_stdout_holds_back_start_up_chatter(capsys):
    from megatransformer.console import held_stdout

    with held_stdout(verbose=False):
        print("DeepSpeed deepspeed_shm_comm_op built successfully")
    with held_stdout(verbose=True):
        print("shown with --verbose")
    with pytest.raises(RuntimeError), held_stdout(verbose=False):
        print("context of a failure")
        raise RuntimeError("start-up failed")
    out, err = capsys.readouterr()
    assert "built successfully" not in out + err
    assert "shown with --verbose" in out and "context of a failure" in err


class Writes(list):
    """A stream that keeps each write apart, as the ranks' shared pipe sees them."""

    def write(self, text: str) -> int:
        self.append(text)
        return len(text)

    def flush(self) -> None:
        pass


def test_an_error_reaches_stderr_in_one_write_so_ranks_do_not_garble_each_other(monkeypatch):
    writes = Writes()
    monkeypatch.setattr(sys, "stderr", writes)
    assert main(["info", "--config", "/nonexistent.yaml"]) == 2
    assert len(writes) == 1 and writes[0].startswith("megatransformer info: error: ") and writes[0].endswith("\n")


def test_a_sample_is_cut_at_its_first_blank_line():
    from megatransformer.commands.train import format_sample

    assert format_sample("The function", " returns\n\n\n\n\n\n") == "sample: The function returns"
    assert format_sample("The", " a\nb\n\nc") == "sample: The a\nb"


@pytest.mark.parametrize("free_mib, sampled", [(1, False), (4096, True), (None, True)])
def test_the_closing_sample_is_skipped_with_a_line_where_the_model_would_not_fit_the_hosts_free_memory(
    monkeypatch, capsys, free_mib, sampled
):
    """The sample loads the whole model on rank 0's host, in fp32 (29 MiB here): a model larger than that host's
    free memory would end a finished run out of memory instead. (None: a host that does not say.)"""
    from support.models import run_config

    from megatransformer.commands import train

    cfg = run_config(train={"sample_prompt": "The"}, model={"d_model": 128, "n_layers": 4, "n_heads": 4})
    assert round(sum(p.numel() for p in build_shapes(cfg.model).parameters()) * 4 / 2**20) == 29
    loads: list = []
    monkeypatch.setattr(
        "megatransformer.inference.available_host_bytes", lambda: None if free_mib is None else free_mib * 2**20
    )
    monkeypatch.setattr("megatransformer.inference.load_for_inference", lambda path: loads.append(path) or 1 / 0)
    if sampled:
        with pytest.raises(ZeroDivisionError):  # (it went on to load the model)
            train.print_sample(cfg, "ckpt", tokenizer=None)
        assert loads == ["ckpt"]
        return
    train.print_sample(cfg, "ckpt", tokenizer=None)
    assert loads == []
    assert capsys.readouterr().out == (
        "sample: skipped: the model's 29 MiB in fp32 would take more than this host has free (1 MiB); continue "
        "train.sample_prompt with `megatransformer generate` where it fits, or partitioned over torchrun's ranks "
        "(--zero-stage 3)\n"
    )


def test_the_hosts_available_memory_is_read_from_the_kernel():
    from megatransformer.inference import available_host_bytes

    assert 0 < available_host_bytes() < os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# ----------------------------------------------------------------------------------------- tokenizer


def test_the_tokenizer_says_when_it_is_smaller_than_asked(tmp_path, capsys):
    corpus = tmp_path / "tiny.txt"
    corpus.write_text("a small corpus\n\nwith few words\n")
    assert (
        main(["data", "tokenizer", "--input", str(corpus), "--vocab-size", "2000", "--out", str(tmp_path / "tok.json")])
        == 0
    )
    out, err = capsys.readouterr()
    size = int(re.search(r"has ([\d,]+) tokens, fewer than the 2,000 asked", err)[1].replace(",", ""))
    assert size < 2000 and f"{size} tokens of 2000 asked" in out
