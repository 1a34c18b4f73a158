"""An elastic resume keeps the checkpoint's global batch and validation rows (training/resume.keep_saved_batch):
in process, from a checkpoint's trainer.json and config.yaml alone."""

from __future__ import annotations

import json

import pytest

from megatransformer.checkpoint.directory import COMPLETE
from megatransformer.config import TrainConfig, dump_config, load_config
from megatransformer.training.checkpointing.resume import keep_saved_batch
from megatransformer.training.runtime.layout import keep_global_batch, validation_batch, validation_rows


def fake_checkpoint(run_dir, world_size: int, *overrides: str):
    """A checkpoint of quickstart (micro 16, eval_batches 4) written by ``world_size`` ranks: the two files
    the decision reads, and the COMPLETE marker."""
    path = run_dir / "checkpoints" / "step_000100"
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(dump_config(load_config("quickstart", [f"run_dir={run_dir}", *overrides])))
    state = dict(step=100, tokens=1, bad_steps=0, tokenizer_sha256=None, world_size=world_size, tensor_parallel=1)
    (path / "trainer.json").write_text(json.dumps(state | {"zero_stage": 0}))
    (path / COMPLETE).write_text("{}")
    return path


def test_a_resume_on_two_ranks_keeps_the_global_batch_and_the_validation_rows(tmp_path):
    fake_checkpoint(tmp_path, 1)
    cfg = load_config("quickstart", [f"run_dir={tmp_path}", "resume=auto"])
    kept, line = keep_saved_batch(cfg, 2)
    t = kept.train
    assert (t.micro_batch_size, t.grad_accum, t.global_batch_size) == (8, 1, 16)
    assert validation_rows(t) == validation_rows(cfg.train) == 64
    assert line.startswith("resume: keeping the checkpoint's global batch 16 on 2 data-parallel ranks: micro 8 x")
    assert "would make it 32" in line and line.count("\n") == 0


def test_the_same_layout_and_an_asked_for_batch_change_are_left_alone(tmp_path):
    fake_checkpoint(tmp_path, 1)
    cfg = load_config("quickstart", [f"run_dir={tmp_path}", "resume=auto"])
    assert keep_saved_batch(cfg, 1) == (cfg, None)
    allowed = load_config("quickstart", [f"run_dir={tmp_path}", "resume=auto", "resume_elastic=allow_batch_change"])
    assert keep_saved_batch(allowed, 2) == (allowed, None)
    other = load_config("quickstart", [f"run_dir={tmp_path}", "resume=auto", "train.global_batch_size=64"])
    assert keep_saved_batch(other, 2) == (other, None)  # (refused later, with the overrides that continue exactly)
    fresh = load_config("quickstart", [f"run_dir={tmp_path / 'new'}"])
    assert keep_saved_batch(fresh, 2) == (fresh, None)


def test_a_resume_on_fewer_ranks_accumulates(tmp_path):
    source = fake_checkpoint(tmp_path / "a", 4)  # global 64
    cfg = load_config("quickstart", [f"run_dir={tmp_path / 'b'}", f"resume={source}"])
    t = keep_saved_batch(cfg, 1)[0].train
    assert (t.micro_batch_size, t.grad_accum, t.global_batch_size, t.eval_rows) == (16, 4, 64, 64)


@pytest.mark.parametrize(
    "given,total,dp,expected",
    [
        (dict(micro_batch_size=16), 16, 2, (8, 1)),
        (dict(micro_batch_size=4, global_batch_size=8), 8, 4, (2, 1)),
        (dict(micro_batch_size=12, global_batch_size=96), 96, 8, (12, 1)),
        (dict(micro_batch_size=16), 48, 1, (16, 3)),
        (dict(micro_batch_size=16), 30, 4, None),
    ],
)
def test_keep_global_batch(given, total, dp, expected):
    sizes = keep_global_batch(TrainConfig(**given), total, dp)
    assert (None if sizes is None else (sizes.micro, sizes.accum)) == expected
    assert sizes is None or sizes.global_batch == total


def test_validation_rows_do_not_depend_on_the_layout():
    """Counted in one data-parallel rank's micro batch; read in batches that divide them."""
    assert validation_rows(TrainConfig(micro_batch_size=4, eval_batches=3)) == 12
    assert validation_rows(TrainConfig(global_batch_size=32, grad_accum=2, eval_batches=2)) == 32
    assert validation_rows(TrainConfig(micro_batch_size=4, eval_rows=10)) == 10
    assert [validation_batch(64, m) for m in (16, 8, 12, 100)] == [16, 8, 8, 64]
