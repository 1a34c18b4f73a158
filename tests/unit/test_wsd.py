"""Warmup-stable-decay (training/optimizers/schedules.py): its shape, a longer run staying stable, and a decay
branched off a stable checkpoint (schedule.decay_from)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from pydantic import ValidationError
from support.models import run_config

from megatransformer.config import ConfigError
from megatransformer.training.optimizers.schedules import branch_decay, lr_multiplier


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
    from megatransformer.training.checkpointing.resume import resolve_resume

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
    from megatransformer.training.checkpointing.resume import check_run_dir

    stable = tmp_path / "checkpoints" / "step_000010"
    stable.mkdir(parents=True)
    (stable / COMPLETE).touch()
    same = wsd(20, decay_from=str(stable)).model_copy(update={"run_dir": str(tmp_path)})
    with pytest.raises(ConfigError, match="give the decay a run_dir of its own"):
        check_run_dir(same)
    check_run_dir(same.model_copy(update={"run_dir": str(tmp_path / "decay")}))


def trainer_state(step: int, **fields):
    from megatransformer.checkpoint import TrainerState

    return TrainerState(
        step=step, tokens=0, bad_steps=0, tokenizer_sha256=None, world_size=1, tensor_parallel=1, zero_stage=0, **fields
    )


def test_the_schedule_phase_of_a_step():
    from megatransformer.training.optimizers.schedules import schedule_phase

    run = wsd(100, decay_steps=20)  # warm-up 10, stable to 80, decay to 100
    assert [schedule_phase(run, s) for s in (5, 10, 80, 81, 100)] == ["warmup", "stable", "stable", "decay", "decay"]
    cosine = run_config(schedule={"name": "cosine", "warmup_steps": 10}, train={"max_steps": 100})
    assert schedule_phase(cosine, 50) == "decay"
    assert schedule_phase(run_config(schedule={"name": "constant", "warmup_steps": 0}), 50) == "stable"


@pytest.mark.parametrize(
    "source, state, message",
    [
        # (a decayed checkpoint: the branch raised the rate 5.5x and decayed again, silently)
        (wsd(100, decay_steps=20), {"step": 90}, "in its decay: it has decayed already"),
        (wsd(100, decay_steps=20), {"step": 90, "schedule_phase": "decay"}, "steps 10 to 80 of that run"),
        (wsd(100, decay_steps=20), {"step": 5}, "in its warm-up"),
        # (a cosine run's checkpoint was accepted without a word)
        (run_config(schedule={"name": "cosine", "warmup_steps": 10}), {"step": 50}, "has no stable phase"),
    ],
)
def test_decay_from_a_checkpoint_outside_a_stable_phase_is_refused_saying_what_it_is(source, state, message):
    from support import assert_one_line

    from megatransformer.training.checkpointing.resume import check_stable

    with pytest.raises(ConfigError) as err:
        check_stable("runs/a", Path("runs/a/checkpoints/step_000090"), trainer_state(**state), source)
    assert_one_line(str(err.value), "schedule.decay_from=runs/a", f"at step {state['step']}", message)
    check_stable("runs/a", Path("x"), trainer_state(50), wsd(100, decay_steps=20))  # stable: accepted


def test_a_branch_of_a_branch_is_refused():
    from megatransformer.checkpoint import DecayOrigin
    from megatransformer.training.checkpointing.resume import check_stable

    branch = branch_decay(wsd(50, decay_from="runs/stable"), 40)
    state = trainer_state(45, schedule_phase="decay", decay_from=DecayOrigin(checkpoint="s", step=40))
    with pytest.raises(ConfigError, match="name a checkpoint of the stable run it was branched from"):
        check_stable("runs/decay", Path("runs/decay/checkpoints/step_000045"), state, branch)


def test_a_restarted_branch_decays_from_where_it_began_though_the_stable_run_went_on(tmp_path):
    from megatransformer.checkpoint import COMPLETE, DecayOrigin, TrainerState
    from megatransformer.training.checkpointing.resume import ResumePlan, decay_start

    stable = tmp_path / "stable" / "checkpoints" / "step_000030"  # the stable run's latest, since the branch began
    stable.mkdir(parents=True)
    (stable / COMPLETE).touch()
    (stable / "trainer.json").write_text(trainer_state(30).model_dump_json())
    branch = wsd(50, decay_from=str(tmp_path / "stable")).model_copy(update={"run_dir": str(tmp_path / "decay")})
    origin = DecayOrigin(checkpoint=str(tmp_path / "stable/checkpoints/step_000010"), step=10)
    own = trainer_state(15, schedule_phase="decay", decay_from=origin)
    assert TrainerState.model_validate_json(own.model_dump_json()) == own  # (trainer.json keeps it)
    plan = ResumePlan(tmp_path / "decay" / "checkpoints" / "step_000015", own, branch, None)
    assert decay_start(branch, plan) == origin


def test_the_run_log_says_the_decay():
    from megatransformer.training.optimizers.schedules import describe_decay

    cfg = branch_decay(wsd(50, decay_from="runs/s", decay_shape="linear", min_lr_ratio=0.1), 40)
    cfg = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"lr": 0.01})})
    line = describe_decay(cfg, "runs/s/checkpoints/step_000040", 40)
    assert line.startswith("decaying from step 40, lr 0.01, to step 50, lr 0.001, linear")


def test_a_branch_with_checkpoints_of_its_own_restarts_without_its_source(tmp_path):
    from megatransformer.checkpoint import COMPLETE
    from megatransformer.training.checkpointing.resume import check_run_dir

    own = tmp_path / "decay" / "checkpoints" / "step_000015"
    own.mkdir(parents=True)
    (own / COMPLETE).touch()
    gone = str(tmp_path / "stable" / "checkpoints" / "step_000010")  # (rotated away by the stable run's keep)
    branch = wsd(20, decay_from=gone).model_copy(update={"run_dir": str(tmp_path / "decay"), "resume": "auto"})
    check_run_dir(branch)  # (the start is in the branch's own trainer state)
    with pytest.raises(ConfigError, match="schedule.decay_from"):
        check_run_dir(branch.model_copy(update={"run_dir": str(tmp_path / "fresh")}))


def test_a_resume_that_changes_the_rate_says_so_and_one_that_undoes_a_decay_says_how_to_decay_again():
    from megatransformer.training.optimizers.schedules import schedule_change

    stable = wsd(100, decay_steps=20)
    assert schedule_change(stable, wsd(300, decay_steps=20), 50) is None  # still stable: the same rate
    assert schedule_change(stable, stable, 95) is None
    line = schedule_change(stable, wsd(300, decay_steps=20), 90)  # in the decay of 100 steps, stable in 300
    assert line is not None and line.startswith(
        "resume: the learning-rate schedule differs from the checkpoint's (train.max_steps=300 (100 there)): "
        "step 91 trains at lr 0.0003, not lr 7.751e-05"
    )
    assert "had decayed and rises again" in line and "schedule.decay_from" in line
    lower = schedule_change(
        stable, stable.model_copy(update={"optim": stable.optim.model_copy(update={"lr": 1e-4})}), 50
    )
    assert lower == (
        "resume: the learning-rate schedule differs from the checkpoint's (optim.lr=0.0001 (0.0003 there)): "
        "step 51 trains at lr 0.0001, not lr 0.0003"
    )


def test_an_extended_decay_branch_says_its_rate_rises_again():
    from megatransformer.training.optimizers.schedules import schedule_change

    finished = branch_decay(wsd(50, decay_from="runs/s"), 40)
    extended = branch_decay(wsd(60, decay_from="runs/s"), 40)
    line = schedule_change(finished, extended, 50)
    assert line is not None and "(train.max_steps=60 (50 there))" in line and "rises again" in line
    assert schedule_change(finished, branch_decay(wsd(50, decay_from="runs/s"), 40), 45) is None
