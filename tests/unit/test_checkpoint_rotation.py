"""The rollback guard against checkpoint rotation: the checkpoint a rollback in the making needs is listed only
once the write in flight (whose rotation may remove checkpoints) is done."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

from megatransformer import checkpoint as ckpt
from megatransformer.config import load_config
from megatransformer.training.loop import Trainer


def test_the_rollback_target_is_listed_after_the_write_in_flight_rotates(tmp_path):
    """checkpoint.keep=1: step 10 complete, step 20 in flight, a spike at step 21; the save of step 30 must spare
    step 20 (what a rollback to before step 21 needs), not step 10, which step 20's rotation removes."""
    root = ckpt.checkpoints_dir(tmp_path)
    for step in (10, 20):
        (root / ckpt.step_name(step)).mkdir(parents=True)
    (root / ckpt.step_name(10) / ckpt.COMPLETE).write_text("")

    def write_in_flight_done() -> None:  # step 20's writer: its manifest, then the rotation (keep=1)
        (root / ckpt.step_name(20) / ckpt.COMPLETE).write_text("")
        shutil.rmtree(root / ckpt.step_name(10), ignore_errors=True)

    saves = []
    checkpointer = SimpleNamespace(wait=write_in_flight_done)
    trainer = object.__new__(Trainer)
    trainer.cfg = load_config("quickstart", [f"run_dir={tmp_path}", "checkpoint.keep=1"])
    trainer.state = ckpt.TrainerState(
        step=30, tokens=0, bad_steps=0, tokenizer_sha256=None, world_size=1, tensor_parallel=1, zero_stage=0
    )
    trainer.decay_origin = None
    trainer.spikes = SimpleNamespace(protect_before=lambda: 21, state_dict=lambda: {})
    trainer.train_loader = SimpleNamespace(state_dict=lambda: {})
    trainer.module = SimpleNamespace(
        checkpointer=checkpointer, save=lambda state, loader, keep: saves.append(keep) or root / ckpt.step_name(30)
    )
    trainer.save()
    assert saves == [(ckpt.step_name(20),)]
