"""Outputs that other tools read whole: the tokenizer's special tokens for transformers, metrics.jsonl rows
with a kind and a time, TensorBoard event files, the W&B config with the resolved values and the run's
facts, override values taken as the strings they are, and a W&B start-up that gives up on a dead server at
once."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time

import pytest
from support.runs import FOUR_STEPS, tiny_data_overrides, train

from megatransformer.config import ConfigError, load_config, validate
from megatransformer.flops import model_size
from megatransformer.training.observability.metrics import start_wandb
from megatransformer.training.observability.trackers import check_tensorboard


@pytest.fixture(scope="module")
def tracked_run(tiny_data, tmp_path_factory):
    """A four-step run through the CLI with W&B offline and TensorBoard on."""
    run = tmp_path_factory.mktemp("outputs") / "run"
    started = time.time()
    overrides = [
        *FOUR_STEPS,
        f"run_dir={run}",
        *tiny_data_overrides(tiny_data),
        "wandb.mode=offline",
        "tensorboard=true",
        "train.sample_prompt=ROMEO:",
        "train.profile.start=2",
        "train.profile.steps=2",
    ]
    result = train(overrides)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return run, result.stdout, records, started


def test_metrics_rows_have_a_kind_a_time_and_one_shape_per_kind(tracked_run):
    _, _, records, started = tracked_run
    steps = [(r["step"], r["kind"]) for r in records if r["kind"] != "checkpoint"]
    assert steps == [(2, "train"), (3, "valid"), (4, "train"), (4, "valid")]
    assert [(r["step"], r["kind"]) for r in records if r["kind"] == "checkpoint"][-1:] == [(4, "checkpoint")]
    times = [r["time"] for r in records]
    assert started <= times[0] and times == sorted(times) and times[-1] <= time.time()
    for kind, shape in (
        ("train", {"loss", "lr", "grad_norm", "tokens", "tokens_per_s", "mfu"}),
        ("valid", {"val_loss", "val_ppl", "val_tokens"}),
        ("checkpoint", {"ckpt_stall_s", "ckpt_setup_s", "ckpt_write_s", "ckpt_bytes"}),
    ):
        keys = [set(r) for r in records if r["kind"] == kind]
        assert all(k == keys[0] for k in keys) and shape <= keys[0], keys
    assert all(r["mfu"] is None for r in records if r["kind"] == "train")  # a CPU with no train.peak_tflops


def test_the_profile_window_leaves_each_ranks_operators_on_file(tracked_run):
    run, stdout, _, _ = tracked_run
    assert "profiling steps 2-3 (train.profile)" in stdout
    assert "profile of 2 step(s): " in stdout and f"{run}/profile/rank_00000.txt and .json" in stdout
    profile = json.loads((run / "profile" / "rank_00000.json").read_text())
    assert profile["steps"] == 2 and profile["step_ms"] > 0 and profile["device_busy_ms"] is None  # (a CPU)
    names = [row["name"] for row in profile["top"]]
    assert profile["sorted_by"] == "self_cpu_time_total" and {"aten::mm", "aten::addmm"} & set(names), names
    assert [row["self_cpu_us"] for row in profile["top"]] == sorted(
        (r["self_cpu_us"] for r in profile["top"]), reverse=True
    )
    assert "Self CPU" in (run / "profile" / "rank_00000.txt").read_text()


def test_tensorboard_holds_the_numbers_of_metrics_jsonl(tracked_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _, records, _ = tracked_run
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    assert loss == [(r["step"], pytest.approx(r["loss"])) for r in records if r["kind"] == "train"]
    valid = [(e.step, e.wall_time) for e in events.Scalars("valid/val_loss")]
    assert valid == [(r["step"], pytest.approx(r["time"])) for r in records if r["kind"] == "valid"]
    assert "train/mfu" not in events.Tags()["scalars"]


def test_wandb_config_is_the_resolved_config_and_the_run_facts(tracked_run):
    run, _, _, _ = tracked_run
    [log] = run.glob("wandb/offline-run-*/run-*.wandb")
    wandb_cli = shutil.which("wandb", path=os.path.dirname(sys.executable)) or "wandb"
    inspected = subprocess.run(
        [wandb_cli, "leet", "inspect", "--summary", "--json", str(log)], capture_output=True, text=True, timeout=300
    )
    config = json.loads(inspected.stdout)["config"]
    assert (
        config["train"]["micro_batch_size"],
        config["train"]["grad_accum"],
        config["train"]["global_batch_size"],
    ) == (2, 1, 2)  # global batch derived, not null
    facts = config["run"]
    assert facts["world_size"] == 1 and facts["data_parallel"] == 1 and facts["tensor_parallel"] == 1
    assert facts["zero_stage"] == 0  # the stage that ran (zero_stage=1 on one rank runs as 0)
    cfg = load_config(os.devnull, FOUR_STEPS)
    assert facts["parameters"] == model_size(cfg.model).params
    assert {"python", "torch", "deepspeed", "megatransformer"} <= set(facts["versions"])


def test_a_plain_text_override_reaches_the_run(tracked_run):
    _, out, _, _ = tracked_run
    assert "sample: ROMEO:" in out


@pytest.mark.parametrize(
    "text, value",
    [
        *[("ROMEO:", "ROMEO:"), ("- item", "- item"), ("#1", "#1"), ("a: b: c", "a: b: c"), ("null", None), ("", None)],
        *[("123", "123"), ("3.10", "3.10"), ("yes", "yes"), ("1e3", "1e3")],  # text, not the number YAML reads
    ],
)
def test_an_override_of_plain_text_is_that_text(text, value):
    assert load_config(os.devnull, [f"train.sample_prompt={text}"]).train.sample_prompt == value


def test_override_collections_are_yaml():
    assert load_config(os.devnull, ["wandb.tags=[x, y]"]).wandb.tags == ["x", "y"]


def test_a_number_for_a_number_field_stays_a_number_and_a_bad_one_is_refused():
    assert load_config(os.devnull, ["train.max_steps=30", "train.sample_prompt=7"]).train.max_steps == 30
    with pytest.raises(ConfigError, match="max_steps"):
        load_config(os.devnull, ["train.max_steps=abc"])


def test_the_tokenizer_directory_loads_in_transformers_with_its_special_tokens(tmp_path, tiny_data):
    from transformers import PreTrainedTokenizerFast

    from megatransformer.cli import main

    out = tmp_path / "tok" / "tokenizer.json"
    assert (
        main(
            [
                "data",
                "tokenizer",
                "--input",
                str(tiny_data.corpus),
                "--vocab-size",
                "400",
                "--sentinels",
                "2",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    tok = PreTrainedTokenizerFast.from_pretrained(str(out.parent))
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.unk_token, tok.mask_token) == (
        "<s>",
        "</s>",
        "<pad>",
        "<unk>",
        "<mask>",
    )
    batch = tok(["def f():", "a longer line of text to pad against"], padding=True)
    assert len(batch["input_ids"][0]) == len(batch["input_ids"][1])
    assert batch["input_ids"][0][-1] == tok.pad_token_id == tok.convert_tokens_to_ids("<pad>")


def test_an_exported_model_directory_has_the_same_tokenizer_roles(tracked_run, tmp_path):
    from transformers import AutoTokenizer

    from megatransformer.cli import main

    run, _, _, _ = tracked_run
    assert main(["export", "--checkpoint", str(run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    tok = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (tok.bos_token, tok.eos_token, tok.pad_token, tok.mask_token) == ("<s>", "</s>", "<pad>", "<mask>")
    assert tok.model_max_length == 64


def test_wandb_goes_offline_at_once_when_its_server_does_not_answer(tmp_path, monkeypatch, capsys):
    with socket.socket() as probe:  # a loopback port that nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("WANDB_API_KEY", "0123456789abcdef0123456789abcdef01234567")
    cfg = validate({"run_dir": str(tmp_path), "wandb": {"mode": "online"}})
    run = start_wandb(cfg)
    try:
        assert run.settings.mode == "offline"
    finally:
        run.finish()
    err = capsys.readouterr().err
    assert f"warning: cannot reach the W&B server, http://127.0.0.1:{port}: " in err and "logging offline" in err


def test_wandb_that_cannot_start_even_offline_leaves_the_run_going_with_a_line(tmp_path, monkeypatch, capsys):
    import wandb

    def refuse(**_):
        raise wandb.errors.CommError("wandb-core did not start within 90 seconds")

    monkeypatch.setattr(wandb, "init", refuse)
    assert start_wandb(validate({"run_dir": str(tmp_path), "wandb": {"mode": "offline"}})) is None
    assert capsys.readouterr().err == (
        "warning: W&B did not start (wandb-core did not start within 90 seconds); the run goes on without it, every "
        f"number in {tmp_path / 'metrics.jsonl'}\n"
    )


def test_tensorboard_without_its_package_is_a_config_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    check_tensorboard(validate({}))
    with pytest.raises(ConfigError, match=r"tensorboard=true needs the tensorboard package: pip install"):
        check_tensorboard(validate({"tensorboard": True}))
