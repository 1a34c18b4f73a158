"""Loss-spike detection and the ladder's decisions, in process; nonsensical thresholds refused up front."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
from support import assert_one_line

from megatransformer.config import SpikesConfig
from megatransformer.training.spikes import ROLLBACK, SKIP, STOP, SpikeDetector, SpikeLadder, resume_state, write_log


def noisy_losses(n: int, level: float = 3.0, noise: float = 0.05, seed: int = 0) -> list[float]:
    return list(level + noise * np.random.default_rng(seed).standard_normal(n))


def test_a_loss_far_above_the_running_median_spikes_and_stays_out_of_the_statistic():
    detector = SpikeDetector(SpikesConfig(window=100, warmup=20))
    assert not any(detector.rejects(loss) for loss in noisy_losses(100))
    limit = detector.threshold()
    assert 3.3 < limit < 3.5  # median 3 + max(6 x 0.05 robust sigma, 10 % of 3)
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
    assert len(ladder.detector.losses) == 30  # the statistic as the checkpoint had it
    for step in (130, 131):
        ladder.respond(step, 9.0)
    assert ladder.respond(132, 9.0).action == STOP  # no rollback left


def test_a_disabled_ladder_rejects_nothing():
    ladder = spiking_ladder(enabled=False)
    assert not ladder.rejects(100.0)


def test_resume_takes_the_rollback_log_when_it_is_newer_than_the_checkpoint(tmp_path):
    checkpoint = {"losses": [1.0], "recent": [5], "rollbacks": 0, "skip_rows": []}
    assert resume_state(checkpoint, tmp_path) == checkpoint
    after = {"losses": [1.0], "recent": [], "rollbacks": 1, "skip_rows": [[8, 96]]}
    write_log(tmp_path, after)
    assert resume_state(checkpoint, tmp_path) == after
    assert resume_state({**after, "rollbacks": 1, "losses": [2.0]}, tmp_path)["losses"] == [2.0]


@pytest.mark.parametrize(
    "override,named",
    [
        ("train.spikes.threshold=0", "train.spikes.threshold"),
        ("train.spikes.warmup=500", "train.spikes.warmup=500"),
        ("train.spikes.rollback_after=80", "train.spikes.rollback_after=80"),
        ("train.spikes.window=1", "train.spikes.window"),
        ("train.watchdog.factor=0.5", "train.watchdog.factor"),
    ],
)
def test_nonsensical_thresholds_are_refused_before_anything_starts(tmp_path, capsys, override, named):
    from megatransformer.cli import main

    assert main(["train", "--config", os.devnull, f"run_dir={tmp_path}", override]) == 2
    assert_one_line(capsys.readouterr().err, named)


@pytest.mark.parametrize("n", [2, 7, 200])
def test_the_threshold_is_median_plus_the_larger_of_the_robust_and_the_relative_rise(n):
    from megatransformer.training.spikes import robust_threshold

    values = np.random.default_rng(n).gamma(2.0, 1.5, n)
    median = np.median(values)
    spread = 1.4826 * np.median(np.abs(values - median))
    cfg = SpikesConfig(threshold=4.0, min_rise=0.2)
    assert robust_threshold(values, cfg) == pytest.approx(median + max(4.0 * spread, 0.2 * median), rel=1e-12)
