"""What a run prints and draws at its end: the closing sample's prompt, the suggested commands, the curves."""

from __future__ import annotations

import json

from megatransformer.checkpoint import TrainerState
from megatransformer.commands.train import next_commands, print_summary, shell_quote, with_closing_prompt
from megatransformer.config import load_config


def test_a_run_on_instructions_closes_with_its_first_prompt_not_the_pretraining_one(tiny_data, tiny_instructions, tok):
    overrides = [
        f"data.train={tiny_instructions.shards}",
        f"data.tokenizer={tiny_data.tokenizer}",
        "objective=prefix_lm",
    ]
    cfg = with_closing_prompt(load_config("quickstart", overrides), overrides, tok)
    first_prompt = tiny_instructions.examples()[0][0]
    assert cfg.train.sample_prompt == first_prompt != load_config("quickstart").train.sample_prompt
    assert f"--prompt {shell_quote(first_prompt)}" in next_commands(cfg)[1]


def test_a_prompt_given_or_text_data_keep_the_config_s_prompt(tiny_data, tiny_instructions, tok):
    given = [
        f"data.train={tiny_instructions.shards}",
        f"data.tokenizer={tiny_data.tokenizer}",
        "train.sample_prompt=Q:",
    ]
    assert with_closing_prompt(load_config("quickstart", given), given, tok).train.sample_prompt == "Q:"
    text = [f"data.train={tiny_data.shards}", f"data.tokenizer={tiny_data.tokenizer}"]
    assert with_closing_prompt(load_config("quickstart", text), text, tok).train.sample_prompt == "The function returns"


def test_a_model_shared_among_a_machines_ranks_is_evaluated_and_sampled_partitioned_among_them():
    data = ["data.train=shards", "data.tokenizer=tok.json"]
    for layout in ("parallel.zero_stage=3", "parallel.tensor_parallel=2"):
        evaluate, sample, export = next_commands(load_config("quickstart", [*data, layout]), ranks=8)
        for command, name in ((evaluate, "eval"), (sample, "generate")):
            assert command.startswith(f"torchrun --nproc-per-node 8 -m megatransformer.cli {name} --checkpoint ")
            assert command.endswith(" --zero-stage 3")
        assert export.startswith("megatransformer export ")  # (one tensor at a time: any machine)
    whole = next_commands(load_config("quickstart", [*data, "parallel.zero_stage=2"]), ranks=8)
    assert all(command.startswith("megatransformer ") and "--zero-stage" not in command for command in whole)
    alone = next_commands(load_config("quickstart", [*data, "parallel.zero_stage=3"]), ranks=1)
    assert all(command.startswith("megatransformer ") for command in alone)


def test_a_run_draws_its_curves_at_its_end_unless_train_plot_is_false(tmp_path, capsys):
    records = [
        {"step": s, "kind": "train", "time": 1.0 + s, "loss": 6.0 - s / 10, "lr": 1e-3, "tokens": 512 * s}
        for s in (1, 2)
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    state = TrainerState(
        step=2, tokens=1024, bad_steps=0, tokenizer_sha256=None, world_size=1, tensor_parallel=1, zero_stage=0
    )
    for plot in (False, True):
        cfg = load_config(None, [f"run_dir={tmp_path}", f"train.plot={str(plot).lower()}", "train.max_steps=2"])
        print_summary(cfg, 0, 1.0, None, state)
        printed = capsys.readouterr().out
        assert (f"plot:                  {tmp_path / 'metrics.png'}" in printed) is plot
        assert (tmp_path / "metrics.png").is_file() is plot
