"""Warmup-stable-decay (training/optim.py): its shape, a longer run staying stable, and a decay branched off a
stable checkpoint (schedule.decay_from)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError
from support.models import run_config

from megatransformer.config import ConfigError
from megatransformer.training.optim import branch_decay, lr_multiplier


def wsd(steps: int = 100, **schedule):
    return run_config(
        schedule={"name": "wsd", "warmup_steps": 10, "min_lr_ratio": 0.0, **schedule}, train={"max_steps": steps}
    )


@pytest.mark.parametrize(
    "shape, halfway",
    [("linear", 0.5), ("cosine", 0.5), ("1-sqrt", 1 - math.sqrt(0.5))],
)
def test_warmup_then_the_peak_then_the_decay_in_its_shape(shape: str, halfway: float):
    f = lr_multiplier(wsd(decay_steps=20, decay_shape=shape))
    assert [f(i) for i in range(3)] == pytest.approx([0.1, 0.2, 0.3])  # step i is the (i+1)-th update
    assert all(f(i) == 1.0 for i in range(9, 80))  # stable: steps 10..80
    assert f(89) == pytest.approx(halfway)  # the 90th update: halfway through the last 20
    assert f(99) == pytest.approx(0.0) and f(500) == pytest.approx(0.0)
    assert all(f(i) >= f(i + 1) for i in range(80, 100))


def test_the_decay_is_a_fraction_of_the_run_unless_given_in_steps_and_ends_at_the_floor():
    f = lr_multiplier(wsd(decay_fraction=0.3, min_lr_ratio=0.1))
    assert f(69) == 1.0 and f(70) < 1.0  # the last 30 of 100 steps decay
    assert f(99) == pytest.approx(0.1)


def test_a_longer_run_stays_stable_where_the_shorter_one_would_have_decayed():
    short, longer = lr_multiplier(wsd(100, decay_steps=20)), lr_multiplier(wsd(300, decay_steps=20))
    assert short(90) < 1.0
    assert [longer(i) for i in range(80, 280)] == [1.0] * 200  # a resume with max_steps=300 at step 80..100: stable
    assert longer(289) == pytest.approx(short(89))  # the same decay, later


def test_a_branched_decay_runs_from_the_checkpoint_to_the_end():
    cfg = branch_decay(wsd(140, decay_from="runs/a/checkpoints/step_000100"), 100)
    f = lr_multiplier(cfg)
    assert cfg.schedule.decay_steps == 40
    assert f(99) == 1.0 and f(100) < 1.0  # the checkpoint's step is the last stable one
    assert f(139) == pytest.approx(0.0)
    with pytest.raises(ConfigError, match="step 140, not before train.max_steps=140"):
        branch_decay(wsd(140, decay_from="x"), 140)


def test_bad_wsd_settings_are_refused_naming_them():
    with pytest.raises(ValidationError, match="schedule.decay_from needs schedule.name=wsd"):
        run_config(schedule={"name": "cosine", "decay_from": "x"})
    with pytest.raises(ValidationError, match="excludes init_from and a resume path"):
        run_config(schedule={"name": "wsd", "decay_from": "x"}, resume="runs/a")
    with pytest.raises(ValidationError, match="exceed train.max_steps=50"):
        wsd(50, decay_steps=45)


def test_decay_from_starts_a_run_that_has_no_checkpoint_and_resume_auto_continues_its_own(tmp_path):
    from megatransformer.checkpoint import COMPLETE
    from megatransformer.training.resume import resolve_resume

    stable = tmp_path / "stable" / "checkpoints" / "step_000010"
    stable.mkdir(parents=True)
    (stable / COMPLETE).touch()
    branch = wsd(20, decay_from=str(stable)).model_copy(update={"run_dir": str(tmp_path / "decay")})
    assert resolve_resume(branch) == stable
    auto = branch.model_copy(update={"resume": "auto"})
    assert resolve_resume(auto) == stable
    own = tmp_path / "decay" / "checkpoints" / "step_000015"
    own.mkdir(parents=True)
    (own / COMPLETE).touch()
    assert resolve_resume(auto) == own


def test_a_decay_needs_a_run_dir_of_its_own(tmp_path):
    from megatransformer.checkpoint import COMPLETE
    from megatransformer.training.resume import check_run_dir

    stable = tmp_path / "checkpoints" / "step_000010"
    stable.mkdir(parents=True)
    (stable / COMPLETE).touch()
    same = wsd(20, decay_from=str(stable)).model_copy(update={"run_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="give the decay a run_dir of its own"):
        check_run_dir(same)
    check_run_dir(same.model_copy(update={"run_dir": str(tmp_path / "decay")}))
