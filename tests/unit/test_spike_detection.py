"""Spike detection (loss and gradient norm) and the ladder's decisions, in process; nonsensical thresholds
refused up front."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from support import assert_one_line
from support.runs import trainer_state_record

from megatransformer.config import SpikesConfig
from megatransformer.training.observability.spikes import (
    GRAD_NORM,
    LOSS,
    ROLLBACK,
    SKIP,
    STOP,
    SpikeDetector,
    SpikeLadder,
    describe,
)


def noisy_losses(n: int, level: float = 3.0, noise: float = 0.05, seed: int = 0) -> list[float]:
    return list(level + noise * np.random.default_rng(seed).standard_normal(n))


def test_a_loss_far_above_the_recent_level_spikes_and_stays_out_of_the_statistic():
    detector = SpikeDetector(SpikesConfig(window=100, warmup=20))
    assert not any(detector.rejects(loss) for loss in noisy_losses(100))
    limit = detector.threshold()
    assert 3.25 < limit < 3.5  # level ~3 + max(6 x 0.05 noise, 10 % of the level)
    assert detector.rejects(limit + 0.01)
    assert detector.threshold() == limit  # a spike does not move the statistic
    assert not detector.rejects(limit - 0.01)
    assert detector.rejects(math.nan) and detector.rejects(math.inf)


def test_no_finite_spike_during_warm_up_and_a_falling_loss_never_spikes():
    detector = SpikeDetector(SpikesConfig(window=50, warmup=10))
    assert not any(detector.rejects(loss) for loss in [9.0, 3.0, 12.0, 2.0, 8.0])  # warming up
    assert detector.rejects(math.nan)  # non-finite is always a spike
    falling = SpikeDetector(SpikesConfig(window=50, warmup=10))
    assert not any(falling.rejects(loss) for loss in np.linspace(10.0, 2.0, 500))


def test_a_flat_curve_needs_the_minimum_rise():
    detector = SpikeDetector(SpikesConfig(window=50, warmup=10, min_rise=0.1))
    for _ in range(50):
        detector.rejects(2.0)  # MAD 0
    assert not detector.rejects(2.19) and detector.rejects(2.21)


def spiking_ladder(**settings) -> SpikeLadder:
    ladder = SpikeLadder(SpikesConfig(window=50, warmup=10, **settings))
    for loss in noisy_losses(50):
        assert not ladder.rejects(loss)
    return ladder


def test_the_ladder_skips_then_rolls_back_then_stops():
    ladder = spiking_ladder(rollback_after=3, within=10, max_rollbacks=1)
    assert ladder.rejects(9.0)
    assert ladder.respond(100, 9.0).action == SKIP
    assert ladder.respond(115, 9.0).action == SKIP  # the first one is more than 10 steps back
    assert ladder.protect_before() == 115  # spikes are recent: the checkpoint before them is kept
    assert ladder.respond(118, 9.0).action == SKIP
    event = ladder.respond(120, 9.0)
    assert (event.action, event.began) == (ROLLBACK, 115)
    ladder.rolled_back((400, 600), {"losses": noisy_losses(30)})
    assert (ladder.rollbacks, ladder.recent, ladder.skip_rows) == (1, [], [[400, 600]])
    assert ladder.protect_before() is None
    assert len(ladder.detector.values) == 30  # the statistic as the checkpoint had it
    for step in (130, 131):
        ladder.respond(step, 9.0)
    assert ladder.respond(132, 9.0).action == STOP  # no rollback left


def noisy_steps(n: int, seed: int = 0) -> list[tuple[float, float]]:
    """(loss, gradient norm) of ``n`` quiet steps: losses near 3, norms near 1 with far more relative noise."""
    norms = 1.0 + 0.2 * np.random.default_rng(seed + 1).standard_normal(n)
    return list(zip(noisy_losses(n, seed=seed), norms.tolist()))


def judging_ladder(**settings) -> SpikeLadder:
    ladder = SpikeLadder(SpikesConfig(window=50, warmup=10, **{"grad_norm": True, **settings}))
    for loss, norm in noisy_steps(50):
        assert not ladder.rejects(loss, norm)
    return ladder


def test_a_gradient_norm_far_above_its_own_median_spikes_while_the_loss_is_normal():
    ladder = judging_ladder()
    limit = ladder.grad_norm_detector.threshold()
    assert 3.9 < limit < 4.1  # level 1 + max(6 x 0.2 noise, 3 x 1): its own threshold, not the loss's
    assert ladder.rejects(3.0, limit + 0.01) and not ladder.rejects(3.0, limit - 0.01)
    assert ladder.rejects(3.0, 8.0)
    event = ladder.respond(60, 3.0, 8.0)
    assert event.spiked == [GRAD_NORM] and event.action == SKIP
    record = event.record(0)
    assert record["spiked"] == ["grad_norm"] and record["spike_grad_norm"] == 8.0
    assert record["grad_norm_threshold"] == ladder.grad_norm_detector.threshold() and record["spike_loss"] == 3.0
    line = describe(event)
    assert line.startswith(
        f"step 60: gradient norm spike, gradient norm 8 (threshold {record['grad_norm_threshold']:.4g})"
    )
    assert "loss" not in line
    both = describe(ladder.respond(61, 9.0, 8.0))
    assert both.startswith("step 61: loss and gradient norm spike, loss 9.0000 (threshold 3.")
    assert ", gradient norm 8 (threshold" in both
    assert ladder.respond(62, 9.0, 1.0).spiked == [LOSS]


def test_a_spike_in_either_quantity_joins_neither_statistic():
    ladder = judging_ladder()
    before = ladder.state_dict()
    assert ladder.rejects(9.0, 1.0) and ladder.rejects(3.0, 9.0) and ladder.rejects(3.0, math.nan)
    assert ladder.state_dict() == before


def test_non_finite_gradients_are_named_as_such():
    ladder = judging_ladder()
    assert describe(ladder.respond(70, 3.0, math.nan)).startswith(
        "step 70: gradient norm spike, gradient norm non-finite"
    )
    assert ladder.respond(71, math.nan, None).spiked == [LOSS]


def test_the_gradient_norm_can_be_left_unjudged_or_judged_with_its_own_bounds():
    assert not SpikesConfig().grad_norm  # (judged by default, a healthy run's rising norm stopped it)
    off = judging_ladder(grad_norm=False)
    assert off.grad_norm_detector is None and not off.rejects(3.0, 100.0)
    assert "grad_norms" not in off.state_dict()
    assert off.rejects(3.0, math.inf)  # non-finite gradients still are
    lenient = judging_ladder(grad_norm_min_rise=20.0)
    assert not lenient.rejects(3.0, 8.0) and lenient.rejects(3.0, 30.0)
    flat = SpikeLadder(SpikesConfig(window=50, warmup=10, grad_norm=True, grad_norm_min_rise=0.5))
    for _ in range(20):
        flat.rejects(3.0, 2.0)  # MAD 0: the minimum rise alone bounds it
    assert not flat.rejects(3.0, 2.99) and flat.rejects(3.0, 3.01)


def test_an_engine_without_a_gradient_norm_is_judged_by_its_loss_alone():
    ladder = judging_ladder()
    norms = ladder.grad_norm_detector.values
    assert not ladder.rejects(3.0, None) and ladder.grad_norm_detector.values == norms
    assert ladder.rejects(9.0, None) and ladder.respond(80, 9.0, None).spiked == [LOSS]


def test_a_resumed_ladder_takes_the_same_decisions_as_the_one_that_went_on():
    ladder = SpikeLadder(SpikesConfig(window=30, warmup=10, grad_norm=True))
    steps = noisy_steps(100, seed=3)
    steps[60:63] = [(3.0, 6.0), (9.0, 1.0), (3.0, 1.0)]
    for loss, norm in steps[:50]:
        ladder.rejects(loss, norm)
    resumed = SpikeLadder(SpikesConfig(window=30, warmup=10, grad_norm=True), ladder.state_dict())
    decisions = [[each.rejects(loss, norm) for loss, norm in steps[50:]] for each in (ladder, resumed)]
    assert decisions[0] == decisions[1] and decisions[0][10:13] == [True, True, False]
    assert resumed.state_dict() == ladder.state_dict()


def test_a_checkpoint_of_an_older_version_without_gradient_norms_loads_and_warms_the_norm_up_again():
    from megatransformer.checkpoint import TrainerState

    spikes = {"losses": noisy_losses(40), "recent": [], "rollbacks": 1, "skip_rows": [[8, 96]]}
    state = TrainerState.model_validate(trainer_state_record(spikes=spikes))
    ladder = SpikeLadder(SpikesConfig(window=50, warmup=10, grad_norm=True), state.spikes.ladder_state())
    assert ladder.detector.values == spikes["losses"] and ladder.rollbacks == 1
    assert ladder.grad_norm_detector.values == [] and ladder.grad_norm_detector.threshold() is None
    assert not ladder.rejects(3.0, 50.0)  # warming up: no finite norm is a spike yet
    assert ladder.rejects(9.0, 1.0)  # the loss's statistic came back whole


def test_a_disabled_ladder_rejects_nothing():
    ladder = spiking_ladder(enabled=False)
    assert not ladder.rejects(100.0)


@pytest.mark.parametrize(
    "override,named",
    [
        ("train.spikes.threshold=0", "train.spikes.threshold"),
        ("train.spikes.warmup=500", "train.spikes.warmup=500"),
        ("train.spikes.rollback_after=80", "train.spikes.rollback_after=80"),
        ("train.spikes.window=1", "train.spikes.window"),
        ("train.spikes.grad_norm_threshold=-1", "train.spikes.grad_norm_threshold"),
        ("train.spikes.grad_norm_min_rise=0", "train.spikes.grad_norm_min_rise"),
        ("train.spikes.grad_norm=maybe", "train.spikes.grad_norm"),
        ("train.watchdog.factor=0.5", "train.watchdog.factor"),
    ],
)
def test_nonsensical_thresholds_are_refused_before_anything_starts(tmp_path, capsys, override, named):
    from megatransformer.cli import main

    assert main(["train", "--config", os.devnull, f"run_dir={tmp_path}", override]) == 2
    assert_one_line(capsys.readouterr().err, named)


@pytest.mark.parametrize("n", [2, 7, 200])
def test_the_threshold_is_the_recent_level_plus_the_larger_of_the_noise_and_the_relative_rise(n):
    from megatransformer.training.observability.spikes import RECENT_STEPS, robust_threshold

    values = np.random.default_rng(n).gamma(2.0, 1.5, n)
    recent = values[-RECENT_STEPS:]
    level = np.median(recent)
    steps = np.diff(values)
    noise = 1.4826 * max(np.median(np.abs(steps - np.median(steps))) / math.sqrt(2), np.median(np.abs(recent - level)))
    assert robust_threshold(values, 4.0, 0.2) == pytest.approx(level + max(4.0 * noise, 0.2 * level), rel=1e-12)


def descent(n: int, seed: int, noise: float = 0.08) -> np.ndarray:
    """An early loss curve: 7.4 falling towards 5.7 (most of it within the first 50 steps), with noise."""
    return 5.7 + 1.7 * np.exp(-np.arange(n) / 15) + noise * np.random.default_rng(seed).standard_normal(n)


def test_a_spike_during_the_runs_own_descent_is_seen():
    """55 steps of descent inflate the MAD of their values: a jump to 7.66 stays under their median + 6 x 1.4826 x
    MAD; measured against the noise around the trend, it spikes."""
    losses = descent(55, seed=5)
    median = np.median(losses)
    assert median + 6 * 1.4826 * np.median(np.abs(losses - median)) > 7.66  # the values' own spread hides it
    detector = SpikeDetector(SpikesConfig())
    assert not any(detector.rejects(loss) for loss in losses)
    assert detector.threshold() < 6.6
    assert detector.rejects(7.66) and detector.rejects(7.0)
    assert not detector.rejects(losses[-1] + 0.2)


@pytest.mark.parametrize("seed", range(5))
def test_healthy_noise_is_no_spike_on_a_descent_that_flattens(seed):
    """Descents steep then flat over 2,000 steps, smooth or sharp at the turn, with little or much noise:
    nothing spikes."""
    rng = np.random.default_rng(seed)
    curves = [
        descent(2000, seed),
        descent(2000, seed, noise=0.2),
        np.concatenate([np.linspace(8.0, 4.0, 300), np.full(1700, 4.0)]) + 0.1 * rng.standard_normal(2000),
    ]
    for curve in curves:
        detector = SpikeDetector(SpikesConfig())
        assert not any(detector.rejects(loss) for loss in curve)


class RecordingRun:
    """What the reporter asks of a W&B run."""

    def __init__(self) -> None:
        self.logged, self.alerts = [], []

    def log(self, values, step):
        self.logged.append((step, values))

    def alert(self, title, text):
        self.alerts.append((title, text))


@pytest.mark.parametrize("mode, alerted", [("online", True), ("offline", False)])
def test_rollbacks_and_stops_alert_on_wandb_when_online(tmp_path, monkeypatch, mode, alerted):
    from megatransformer.config import load_config
    from megatransformer.training.observability import metrics

    cfg = load_config(os.devnull, [f"run_dir={tmp_path}", "wandb.mode=disabled"])
    reporter = metrics.Reporter(cfg, is_main=True, start_step=0)
    reporter.wandb = RecordingRun()
    monkeypatch.setattr(metrics, "wandb_mode", lambda cfg: mode)
    for step, event in ((10, "skip"), (11, "rollback"), (30, "stop")):
        reporter.event({"step": step, "event": event, "spike_loss": 9.0, "threshold": 6.0}, f"line {step}")
    assert [step for step, _ in reporter.wandb.logged] == [10, 11, 30]
    assert reporter.wandb.logged[0][1] == {"spikes/loss": 9.0, "spikes/threshold": 6.0}
    expected = [("loss spike: rollback", "line 11"), ("loss spike: stop", "line 30")] if alerted else []
    assert reporter.wandb.alerts == expected
    assert [r["event"] for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())] == [
        "skip",
        "rollback",
        "stop",
    ]


def test_the_loss_panel_marks_each_spike_and_each_rollback():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from megatransformer.commands.plot import mark_spikes

    fig, ax = plt.subplots()
    events = [
        {"step": 89, "event": "skip", "spike_loss": 9.8},
        {"step": 90, "event": "skip", "spike_loss": 9.9},
        {"step": 91, "event": "rollback", "spike_loss": 9.7},
    ]
    mark_spikes(ax, "run", events)
    [crosses] = [line for line in ax.lines if line.get_marker() == "x"]
    assert list(crosses.get_xdata()) == [89, 90, 91] and list(crosses.get_ydata()) == [9.8, 9.9, 9.7]
    [rollback] = [line for line in ax.lines if line.get_linestyle() == "--"]
    assert list(rollback.get_xdata()) == [91, 91] and rollback.get_label() == "run rollbacks"
    plt.close(fig)


def test_vanished_gradients_or_a_uniform_output_for_a_window_of_steps_stop_the_run():
    from megatransformer.training.observability.spikes import DeadRun

    uniform = math.log(256)
    dead = DeadRun(256, limit=3, after_step=2)
    assert dead.see(1, 5.0, 0.0) is None and dead.see(2, 5.0, 0.0) is None  # two steps without gradients
    assert dead.see(3, 4.9, 0.7) is None  # learning again: the count starts over
    assert dead.see(4, 5.0, 0.0) is None and dead.see(5, uniform, 0.3) is None  # a uniform output counts too
    line = dead.see(6, uniform + 1e-5, 0.0)
    assert_one_line(line, "step 6", "3 steps in a row since step 4", "train.max_dead_steps=3", "gradient norm of 0")
    assert dead.see(7, 5.0, 1e-20) is not None  # (vanished: far below any model's own)
    assert "uniform output" in line and "optim.lr" in line


def test_a_uniform_loss_during_warm_up_or_a_near_uniform_healthy_loss_is_no_dead_run():
    from megatransformer.training.observability.spikes import DeadRun

    uniform = math.log(32000)
    dead = DeadRun(32000, limit=2, after_step=10)
    assert all(dead.see(step, uniform, 0.5) is None for step in range(1, 11))  # (a zero-initialised head warms up)
    assert all(dead.see(step, uniform + 0.01 * (step % 2), 0.5) is None for step in range(11, 30))
    assert dead.see(30, uniform + 0.01, None) is None  # (no norm computed: judged by the loss alone)
    never = DeadRun(32000, limit=0)
    assert all(never.see(step, uniform, 0.0) is None for step in range(1, 100))
