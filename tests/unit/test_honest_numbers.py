"""Numbers that do not mislead: no MFU on a CPU without a stated peak (and no MFU panel then), a warning when
the warm-up is longer than the run, a warning when BLEU scores empty hypotheses."""

from __future__ import annotations

import json

import pytest

from megatransformer.commands.eval import empty_hypotheses_warning
from megatransformer.commands.plot import draw, panels
from megatransformer.config import validate
from megatransformer.training.observability.metrics import Reporter, peak_tflops
from megatransformer.training.optimizers.schedules import warmup_warning


def test_a_cpu_has_no_peak_unless_one_is_given():
    assert peak_tflops(validate({}), "cpu") is None
    assert peak_tflops(validate({"train": {"peak_tflops": 1.5}}), "cpu") == 1.5


def test_the_console_line_shows_mfu_only_when_there_is_one(tmp_path):
    cfg = validate({"run_dir": str(tmp_path), "train": {"max_steps": 10}, "wandb": {"mode": "disabled"}})
    report = Reporter(cfg, is_main=False, start_step=0)
    record = {"step": 5, "loss": 2.5, "lr": 1e-3, "tokens_per_s": 1000.0, "mfu": None}
    assert "MFU" not in report.train_line(record)
    assert "| MFU 12.50% |" in report.train_line({**record, "mfu": 0.125})


def test_the_plot_has_an_mfu_panel_only_when_some_run_has_mfu(tmp_path):
    train = {"kind": "train", "loss": 3.0, "lr": 1e-3, "tokens_per_s": 900.0}
    cpu = [{"step": s, **train, "mfu": None} for s in (1, 2)]
    gpu = [{"step": s, **train, "mfu": 0.4} for s in (1, 2)]
    assert [key for key, _, _ in panels([cpu])] == ["loss", "lr", "tokens_per_s"]
    assert [key for key, _, _ in panels([cpu, gpu])] == ["loss", "lr", "tokens_per_s", "mfu"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in cpu))
    assert draw([run], tmp_path / "plot.png").stat().st_size > 0


@pytest.mark.parametrize("warmup, steps, warned", [(2000, 20, True), (20, 20, False), (0, 5, False)])
def test_a_warmup_longer_than_the_run_is_warned_about(warmup, steps, warned):
    cfg = validate({"train": {"max_steps": steps}, "schedule": {"warmup_steps": warmup}})
    warning = warmup_warning(cfg)
    assert (warning is not None) == warned
    if warned:
        assert warning == (
            "warning: schedule.warmup_steps=2000 is longer than the run (train.max_steps=20): the "
            "learning rate reaches only 1% of its peak; lower schedule.warmup_steps"
        )


def test_empty_hypotheses_are_warned_about():
    assert empty_hypotheses_warning(["", "", ""]).startswith("warning: 3 of 3 hypotheses are empty")
    assert empty_hypotheses_warning(["a"] * 8 + ["", ""]).startswith("warning: 2 of 10 hypotheses are empty")
    assert empty_hypotheses_warning(["a"] * 19 + [""]) is None


def test_the_plot_draws_the_gradient_norm_and_bits_per_byte_on_an_axis_of_their_own(tmp_path):
    train = [
        {"step": s, "kind": "train", "loss": 3.0, "lr": 1e-3, "tokens_per_s": 9.0, "grad_norm": g}
        for s, g in ((1, 8.0), (2, 0.5))
    ]
    valid = {"step": 2, "kind": "valid", "eval/hellaswag/acc": 0.3, "eval/wikitext/bits_per_byte": 1.7}
    assert [key for key, _, _ in panels([train + [valid]])] == ["loss", "lr", "grad_norm", "tokens_per_s", "eval/"]
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [*train, valid]))
    assert draw([run], tmp_path / "plot.png").stat().st_size > 0
