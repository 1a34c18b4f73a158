"""``checkpoint convert`` of the format before shards: damaged files refused in one line naming them, a kill between
its renames recovered (by resume=auto or the next convert), each parameter's kinds of state kept (Muon's)."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

from megatransformer import checkpoint as ckpt
from megatransformer.checkpoint import sharded
from megatransformer.checkpoint.sharded import ShardedState, convert_consolidated, finish_conversions
from megatransformer.config import validate
from megatransformer.training.checkpointing.resume import resolve_resume

WEIGHTS = {"m": torch.arange(16.0).reshape(4, 4), "b": torch.arange(4.0), "tied": torch.arange(16.0).reshape(4, 4)}
ADAM = {f"{kind}/{name}": WEIGHTS[name] * k for k, kind in ((2, "exp_avg"), (3, "exp_avg_sq")) for name in ("m", "b")}
MUON = {"momentum_buffer/m": WEIGHTS["m"] * 5, "exp_avg/b": WEIGHTS["b"] * 2, "exp_avg_sq/b": WEIGHTS["b"] * 3}


def old_checkpoint(path: pathlib.Path, moments=ADAM, trainer=None, weights=WEIGHTS) -> pathlib.Path:
    """A step directory as the format before shards wrote it (the whole weights and optimizer state)."""
    path.mkdir(parents=True)
    ckpt.save_safetensors(dict(weights), path / ckpt.WEIGHTS)
    ckpt.save_safetensors(dict(moments), path / ckpt.OPTIMIZER, {"adam_step": "7", "lr_scheduler": "{}"})
    state = {"step": 7, "tokens": 0, "bad_steps": 0, "tokenizer_sha256": None, "world_size": 1}
    (path / ckpt.TRAINER_STATE).write_text(json.dumps(trainer or {**state, "tensor_parallel": 1, "zero_stage": 0}))
    ckpt.write_manifest(path)
    return path


def convert_command(path: pathlib.Path) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "megatransformer.cli", "checkpoint", "convert", str(path)]
    return subprocess.run(command, capture_output=True, text=True)


@pytest.mark.parametrize(
    "damage,file,why",
    [
        (dict(trainer={"steps": 7}), "trainer.json", "no step count in it"),
        (dict(moments={**ADAM, "exp_avg/gone": torch.zeros(3)}), "optimizer.safetensors", "exp_avg/gone: no weight"),
        (dict(moments={**ADAM, "exp_avg/b": torch.zeros(9)}), "optimizer.safetensors", "exp_avg/b: no weight of its"),
        (dict(weights={**WEIGHTS, "tied": torch.ones(4, 4)}), "optimizer.safetensors", "no state for tied"),
    ],
)
def test_a_damaged_old_checkpoint_is_refused_in_one_line_naming_the_file(tmp_path, damage, file, why):
    path = old_checkpoint(tmp_path / "step_000007", **damage)
    with pytest.raises(ckpt.CheckpointDamaged, match=f"{file}: {why}") as err:
        convert_consolidated(path)
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000007"]  # (nothing written beside it)


def test_an_unreadable_optimizer_file_is_named_by_the_command(tmp_path):
    path = old_checkpoint(tmp_path / "step_000007")
    (path / ckpt.OPTIMIZER).write_bytes(b"\xff" * 64)
    ckpt.write_manifest(path)  # (a manifest made to match)
    done = convert_command(path)
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert "optimizer.safetensors: unreadable" in line


def test_each_parameter_keeps_its_kinds_of_state(tmp_path):
    """Muon's matrices a momentum, the others Adam's moments: no Adam state is made for a matrix at a load."""
    path = convert_consolidated(old_checkpoint(tmp_path / "step_000007", MUON))
    ckpt.verify_checkpoint(path)
    state = ShardedState(path)
    assert state.kinds == ["fp32", "exp_avg", "exp_avg_sq", "momentum_buffer"]
    assert state.kinds_of("m") == ["fp32", "momentum_buffer"] and state.kinds_of("tied") == state.kinds_of("m")
    assert state.kinds_of("b") == ["fp32", "exp_avg", "exp_avg_sq"]
    assert torch.equal(state.tensor("m", "momentum_buffer"), WEIGHTS["m"] * 5)
    assert torch.equal(state.tensor("b", "exp_avg_sq"), WEIGHTS["b"] * 3) and state.aliases == {"tied": "m"}


@pytest.mark.parametrize("recovery", ["resume", "convert"])
def test_a_kill_between_the_renames_is_recovered(tmp_path, monkeypatch, recovery):
    root = ckpt.checkpoints_dir(tmp_path)
    path = old_checkpoint(root / "step_000007")
    (root / ckpt.LATEST).write_text(path.name)
    rename = pathlib.Path.rename

    def killed_at_the_second(self, target):
        if self.name.endswith(".converting"):
            raise KeyboardInterrupt  # (as a kill between the two renames leaves it)
        return rename(self, target)

    monkeypatch.setattr(pathlib.Path, "rename", killed_at_the_second)
    with pytest.raises(KeyboardInterrupt):
        convert_consolidated(path)
    monkeypatch.setattr(pathlib.Path, "rename", rename)
    assert not path.exists() and (root / ".step_000007.converting").is_dir()
    if recovery == "resume":
        assert resolve_resume(validate({"run_dir": str(tmp_path), "resume": "auto"})) == path
    else:
        done = convert_command(path)
        assert done.returncode == 0 and "step_000007: finished its conversion" in done.stdout, done.stderr
    assert sorted(p.name for p in root.iterdir()) == [ckpt.LATEST, "step_000007"]
    assert (path / sharded.INDEX).is_file()
    ckpt.verify_checkpoint(path)


def test_a_conversion_cut_short_before_its_manifest_is_undone(tmp_path):
    root = ckpt.checkpoints_dir(tmp_path)
    path = old_checkpoint(root / "step_000007")
    new = root / ".step_000007.converting"
    new.mkdir()
    path.rename(root / ".step_000007.consolidated")
    assert finish_conversions(root) == ["step_000007: undid its conversion to the sharded format, cut short by a kill"]
    assert sorted(p.name for p in root.iterdir()) == ["step_000007"]
    ckpt.verify_checkpoint(path)
