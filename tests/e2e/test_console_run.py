"""The training console of a real run: the numbers of metrics.jsonl, the closing summary with the next
commands, and plots written next to the run."""

from __future__ import annotations

import re

import pytest
from support.runs import FOUR_STEPS, metrics, tiny_data_overrides, train

from megatransformer.cli import main


@pytest.fixture(scope="module")
def short_run(tiny_data, tmp_path_factory):
    """A four-step run through the real CLI: logs every 2 steps, validates at step 3 and at the end, draws its
    curves."""
    run = tmp_path_factory.mktemp("console") / "run"
    overrides = [
        *FOUR_STEPS,
        f"run_dir={run}",
        *tiny_data_overrides(tiny_data),
        "train.sample_prompt=The function",
        "train.peak_tflops=0.5",
        "wandb.mode=disabled",
        "train.plot=true",
    ]
    result = train(overrides, expect=None)
    assert result.returncode == 0, result.stdout + result.stderr
    return run, result.stdout, metrics(run)


def test_console_shows_the_numbers_of_metrics_jsonl(short_run):
    run, out, records = short_run
    lines = re.findall(
        r"^step (\d+)/4 \| loss (\S+) \| lr (\S+) \| ([\d,]+) tok/s \| MFU ([\d.]+)% \| ETA \S+$", out, re.M
    )
    train = [r for r in records if "loss" in r]
    assert [int(step) for step, *_ in lines] == [r["step"] for r in train] == [2, 4]
    for (_step, loss, lr, speed, mfu), record in zip(lines, train):
        assert loss == f"{record['loss']:.4f}" and float(lr) == pytest.approx(record["lr"], rel=1e-2)
        assert speed == f"{record['tokens_per_s']:,.0f}" and mfu == f"{100 * record['mfu']:.2f}"
    valid = [r for r in records if "val_loss" in r]
    assert [r["step"] for r in valid] == [3, 4]
    for record in valid:
        assert f"step {record['step']}: validation loss {record['val_loss']:.4f}" in out
    assert "built successfully" not in out
    # (the default warm-up of 100 steps is longer than these 4: said once, before the first step)
    warning = "warning: schedule.warmup_steps=100 is longer than the run (train.max_steps=4)"
    assert out.count(warning) == 1 and out.index(warning) < out.index("step 2/4")


def test_a_run_ends_with_a_summary_and_the_next_commands(short_run):
    run, out, records = short_run
    summary = out[out.index("done: ") :]
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
    sample = out[out.index("sample: ") : out.index("done: ")]
    assert "\n\n" not in sample.rstrip("\n") + "\n"  # cut at its first blank line


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
