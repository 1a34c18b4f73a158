"""Messages that name the real cause, in one line: missing and unreadable data, a shard a loader worker finds
damaged, absurd step counts, a config error under torchrun (once), and a description for every command."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess

import pytest
from support.runs import launch_command, torchrun

from data_pipeline import DataError
from data_pipeline.shard import Manifest
from megatransformer.cli import build_parser, main
from megatransformer.config import MAX_STEPS, ConfigError, load_config, shipped_configs

# ------------------------------------------------------------------------------------------------ help


def sub_parsers(parser: argparse.ArgumentParser, name: str = "megatransformer"):
    """Every (name, parser) below ``parser``, sub-commands of sub-commands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield f"{name} {sub_name}", sub
                yield from sub_parsers(sub, f"{name} {sub_name}")


def test_every_command_has_a_description():
    commands = dict(sub_parsers(build_parser()))
    assert {
        "megatransformer export",
        "megatransformer import",
        "megatransformer info",
        "megatransformer average",
        "megatransformer data shard",
    } <= set(commands)
    missing = [name for name, parser in commands.items() if not parser.description]
    assert missing == []


def test_config_help_names_the_shipped_configs_without_looking_like_a_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "1000")  # (argparse wraps help to the terminal, breaking at hyphens)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "(llama-style)" not in help_text
    assert "or one of the shipped configs by name: " + ", ".join(shipped_configs()) in help_text


# ------------------------------------------------------------------------------------------------ data


def test_a_data_path_that_does_not_exist_says_so(tmp_path, tiny_data, capsys):
    missing = tmp_path / "nope"
    for split in ("train", "valid"):
        assert (
            main(
                [
                    "data",
                    "inspect",
                    "--config",
                    "quickstart",
                    f"data.train={tiny_data.shards}",
                    f"data.{split}={missing}",
                    f"data.tokenizer={tiny_data.tokenizer}",
                    "model.vocab_size=512",
                    "--split",
                    split,
                ]
            )
            == 2
        )
        assert capsys.readouterr().err == (
            f"megatransformer data inspect: error: {missing} does not exist; give a "
            "shard directory written by `megatransformer data shard`\n"
        )


def test_a_manifest_of_random_bytes_is_one_line_naming_it(tmp_path, tiny_data):
    shards = tmp_path / "shards"
    shutil.copytree(tiny_data.shards, shards)
    (shards / "manifest.json").write_bytes(os.urandom(256) + b"\xff\xfe")
    with pytest.raises(DataError) as error:
        Manifest.load(shards)
    message = str(error.value)
    assert message.startswith(f"{shards / 'manifest.json'} is not a valid shard manifest") and "\n" not in message


def test_a_damaged_shard_read_by_a_loader_worker_is_one_line_naming_it(tmp_path, tiny_data):
    from data_pipeline.tokenizer import load_tokenizer
    from megatransformer.config import validate
    from megatransformer.training.data import build_run_loader

    shards = tmp_path / "shards"
    shutil.copytree(tiny_data.shards, shards)
    for info in Manifest.load(shards).splits["train"]:  # every shard: whichever the worker opens first
        victim = shards / info.file
        victim.write_bytes(victim.read_bytes()[:1000])
    cfg = validate(
        {
            "model": {"vocab_size": 512, "max_seq_len": 64, "d_model": 32, "n_heads": 2},
            "data": {"train": str(shards), "tokenizer": str(tiny_data.tokenizer), "seq_len": 64, "num_workers": 1},
        }
    )
    loader = build_run_loader(cfg, "train", 4, 0, 1, load_tokenizer(tiny_data.tokenizer))
    with pytest.raises(DataError) as error:
        next(iter(loader))
    message = str(error.value)
    assert message.startswith(f"corrupt shard {shards}/train-") and "on_corrupt=skip" in message
    assert "\n" not in message and "worker" not in message


# ------------------------------------------------------------------------------------------ step counts


@pytest.mark.parametrize(
    "value,message",
    [
        ("0", "train.max_steps=0 must be >= 1"),
        ("1.0e+12", f"train.max_steps=1000000000000.0 must be <= {MAX_STEPS}"),
        ("1e30", "config key 'train.max_steps'"),
    ],
)
def test_absurd_step_counts_are_refused(value, message):
    with pytest.raises(ConfigError, match=message.replace("+", r"\+")):
        load_config("quickstart", [f"train.max_steps={value}"])
    assert load_config("quickstart", [f"train.max_steps={MAX_STEPS}"]).train.max_steps == MAX_STEPS


# ---------------------------------------------------------------------------------------------- torchrun


def test_a_config_error_is_printed_by_the_first_local_rank_only(monkeypatch, capsys):
    from megatransformer.training.runtime import failure_board

    said = []
    monkeypatch.setattr(failure_board, "wait_until_printed", lambda: said.append("waited"))
    monkeypatch.setattr(failure_board, "say_printed", lambda: said.append("printed"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert main(["info", "--config", "quickstart", "train.max_stepz=3"]) == 2
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert main(["info", "--config", "quickstart", "train.max_stepz=3"]) == 2
    assert "did you mean 'train.max_steps'?" in capsys.readouterr().err
    assert said == ["waited", "printed"]  # (the quiet rank exits once the first has printed)


def test_once_a_group_has_started_every_rank_prints_its_own_error(monkeypatch, capsys):
    """eval and generate start their groups themselves (``lockstep.joined``): an error after that may be one rank's."""
    from megatransformer.training.runtime import distributed, failure_board

    monkeypatch.setattr(distributed, "_started", False)
    monkeypatch.setattr(failure_board, "wait_until_printed", lambda: pytest.fail("a rank of a running group waited"))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    distributed.note_group_started()
    assert main(["info", "--config", "quickstart", "train.max_stepz=3"]) == 2
    assert "did you mean 'train.max_steps'?" in capsys.readouterr().err


# `megatransformer train` under torchrun, rank 0 ten seconds late, as on a loaded machine: torchrun ends the others
# once one has failed (rank 0 has no signal handler before the trainer's)
TRAIN_WITH_RANK_0_LATE = """
import os, runpy, sys, time
if os.environ["LOCAL_RANK"] == "0":
    time.sleep(10)
sys.argv[1:1] = ["train"]
runpy.run_module("megatransformer.cli", run_name="__main__")
"""


@pytest.mark.parametrize("rank_0_late", [False, True], ids=["together", "rank-0-late"])
def test_under_torchrun_a_config_error_is_printed_once(rank_0_late, tmp_path):
    command = launch_command(2)
    if rank_0_late:
        script = tmp_path / "train_late.py"
        script.write_text(TRAIN_WITH_RANK_0_LATE)
        command = [*torchrun(2), str(script)]
    result = subprocess.run(
        [*command, "--config", "quickstart", "train.max_stepz=3"], capture_output=True, text=True, timeout=600
    )
    assert result.returncode != 0
    errors = [line for line in (result.stdout + result.stderr).splitlines() if "megatransformer train: error" in line]
    assert errors == [
        "megatransformer train: error: unknown config key 'train.max_stepz'; did you mean 'train.max_steps'?"
    ]
