"""The loss-spike detector replayed on recorded loss curves: which steps it calls spikes, and how close a healthy
curve comes to its threshold, beside the statistic it replaced (the window's median + 6 x 1.4826 x MAD of the
values themselves, window 200).

Each curve is a run's metrics.jsonl, recorded with ``train.log_every=1 train.spikes.enabled=false`` (so that
nothing is skipped and every loss is there). A replay feeds the losses in order: a loss that spikes is left out
of the statistic, as in a run. "closest" is the largest (loss - level) / (threshold - level) of the steps judged:
below 1 nothing spiked (how near a healthy curve came), above 1 how far the largest spike cleared its threshold.

    python bench/spike_detector.py RUN_DIR/metrics.jsonl ...

No timing: the numbers depend on the curves alone.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import numpy as np

from megatransformer.config import SpikesConfig
from megatransformer.training.observability.spikes import RECENT_STEPS, ROBUST_SIGMA, robust_threshold

Threshold = Callable[[np.ndarray], tuple[float, float]]  # accepted values -> (level, threshold)


def median_and_mad(values: np.ndarray, window: int = 200, sigmas: float = 6.0, min_rise: float = 0.1):
    """The statistic this one replaced: the window's median + max(6 x 1.4826 x MAD, 10 % of the median)."""
    values = values[-window:]
    median = float(np.median(values))
    spread = ROBUST_SIGMA * float(np.median(np.abs(values - median)))
    return median, median + max(sigmas * spread, min_rise * abs(median))


DEFAULTS = SpikesConfig()


def current(values: np.ndarray, cfg: SpikesConfig = DEFAULTS):
    """The detector of training/observability/spikes.py with train.spikes' defaults."""
    values = values[-cfg.window :]
    return float(np.median(values[-RECENT_STEPS:])), robust_threshold(values, cfg.threshold, cfg.min_rise)


def replay(losses: list[tuple[int, float]], threshold: Threshold, warmup: int = 50) -> tuple[list[int], float, int]:
    """The steps that spike, and the closest ratio with its step."""
    accepted, spikes, closest = [], [], (float("-inf"), 0)
    for step, loss in losses:
        if len(accepted) >= warmup:
            level, limit = threshold(np.array(accepted))
            closest = max(closest, ((loss - level) / (limit - level), step))
            if loss > limit:
                spikes.append(step)
                continue
        accepted.append(loss)
    return spikes, *closest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files of runs with every step logged")
    args = parser.parse_args()
    print(f"{'curve':60s} {'detector':14s} {'closest':>8s} {'at':>5s}  spikes")
    for path in args.metrics:
        records = [json.loads(line) for line in open(path)]
        losses = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
        for name, threshold in (("median + MAD", median_and_mad), ("current", current)):
            spikes, ratio, step = replay(losses, threshold)
            shown = ", ".join(map(str, spikes[:8])) + (" ..." if len(spikes) > 8 else "")
            print(f"{path[-60:]:60s} {name:14s} {ratio:8.2f} {step:5d}  {shown or '-'}")


if __name__ == "__main__":
    main()
