"""What a run prints at its end: the closing sample's prompt and the suggested commands."""

from __future__ import annotations

from megatransformer.commands.train import next_commands, shell_quote, with_closing_prompt
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
