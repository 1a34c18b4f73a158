"""Checkpoint files without a run: DeepSpeed's state classes through the safe loader, torn metrics lines, what
`average --last` finds."""

from __future__ import annotations

import pytest
import torch

from megatransformer import checkpoint as ckpt
from megatransformer.checkpoint import integrity
from megatransformer.config import ConfigError
from megatransformer.training.checkpointing import checkpointer


def test_deepspeeds_state_classes_are_allowed(tmp_path):
    """The classes DeepSpeed's states hold load with weights_only, the fp16 loss scaler too (which only a
    GPU run writes)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    scaler = DynamicLossScaler(
        init_scale=2**16, scale_window=1000, min_scale=1, delayed_shift=2, consecutive_hysteresis=False
    )
    torch.save({"dynamic": scaler, "static": LossScaler(4.0), "stage": ZeroStageEnum.weights}, tmp_path / "s.pt")
    integrity._refuse_unsafe_pickle(tmp_path / "s.pt")
    loaded = ckpt.safe_load(tmp_path / "s.pt", allowed=checkpointer.deepspeed_safe_globals())
    assert vars(loaded["dynamic"]) == vars(scaler) and loaded["static"].cur_scale == 4.0
    assert loaded["stage"] is ZeroStageEnum.weights


def test_a_torn_last_metrics_line_is_dropped_a_bad_middle_line_is_an_error(tmp_path, capsys):
    from megatransformer.training.observability.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    truncate_metrics(path, after_step=2)
    assert path.read_text() == '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n'
    assert "the last line" in capsys.readouterr().err
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        truncate_metrics(path, after_step=2)


@pytest.mark.parametrize(
    "keep, said",
    [
        (2, "the run kept its last checkpoint.keep=2; raise checkpoint.keep"),
        (5, "the run wrote no more: one every checkpoint.every=200 steps and one at its end; lower checkpoint.every"),
    ],
)
def test_average_last_says_why_a_run_has_fewer_checkpoints(tmp_path, keep, said):
    from megatransformer.commands.average import last_checkpoints
    from megatransformer.config import dump_config, validate

    config = dump_config(validate({"checkpoint": {"every": 200, "keep": keep}}))
    for step in (400, 600):
        path = ckpt.checkpoints_dir(tmp_path) / ckpt.step_name(step)
        path.mkdir(parents=True)
        (path / ckpt.CONFIG).write_text(config)
        (path / ckpt.COMPLETE).write_text("")
    with pytest.raises(ConfigError) as err:
        last_checkpoints("5", str(tmp_path))
    assert str(err.value).startswith(
        f"--last 5 {tmp_path}: only 2 complete checkpoints in {ckpt.checkpoints_dir(tmp_path)} ({said}"
    )
    assert len(last_checkpoints("2", str(tmp_path))) == 2


def test_a_marker_is_fsynced_before_its_rename_and_its_directory_after(tmp_path, monkeypatch):
    """COMPLETE and `latest` (atomic_write, write_manifest) survive a power loss once written: the file's data is
    on disk before the rename publishes it, the rename itself after the directory's fsync."""
    import os

    events: list[tuple[str, str]] = []
    fsync, replace = os.fsync, os.replace

    def fsync_of(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync_of)
    monkeypatch.setattr(os, "replace", lambda a, b: events.append(("replace", str(b))) or replace(a, b))
    root = tmp_path / "checkpoints"
    (root / "step_000001").mkdir(parents=True)
    ckpt.write_manifest(root / "step_000001", {})
    ckpt.atomic_write(root / ckpt.LATEST, "step_000001")
    step = root / "step_000001"
    assert events == [
        ("fsync", str(step / ".COMPLETE.tmp")),
        ("replace", str(step / ckpt.COMPLETE)),
        ("fsync", str(step)),
        ("fsync", str(root / ".latest.tmp")),
        ("replace", str(root / ckpt.LATEST)),
        ("fsync", str(root)),
    ]


def test_the_staging_copies_lie_whole_in_blocks_of_a_power_of_two_kept_from_save_to_save(monkeypatch):
    """(CUDA's pinned allocator rounds each allocation up to a power of two: a buffer a piece took up to twice the
    pieces' bytes; blocks of a power of two lose a tail each)"""
    monkeypatch.setattr(checkpointer, "STAGING_BLOCK_BYTES", 64)  # (16 fp32 elements)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda size, dtype, pin_memory: empty(size, dtype=dtype))  # (no CUDA here)
    staging = checkpointer.StagingBlocks(pinned=True)
    sizes = [5, 7, 6, 20, 3, 0]  # (a piece larger than a block: blocks of its power of two, 32)
    views = staging.views(sizes)
    assert [v.numel() for v in views] == sizes
    assert [b.numel() for b in staging.blocks] == [18, 23]  # (20 does not fit after 18 of 32: a new block)
    assert all(b.numel() <= 32 for b in staging.blocks)
    spans = sorted((v.data_ptr(), v.data_ptr() + 4 * v.numel()) for v in views if v.numel())
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # (no two pieces overlap)
    for size, view in zip(sizes, views):
        view.copy_(torch.arange(size, dtype=torch.float32))
    assert [v.tolist() for v in views] == [list(map(float, range(size))) for size in sizes]
    assert all(a is b for a, b in zip(staging.views(sizes), views))  # (the same buffers at the next save)
    assert [v.numel() for v in staging.views([4, 4])] == [4, 4] and len(staging.blocks) == 1


def test_pageable_staging_copies_are_a_buffer_each():
    """(On a CPU nothing rounds them; one large block would not fit the holes of the heap: 1.30x the planned peak
    at 4 ZeRO-3 ranks against 1.02x, BENCHMARKS 5au)"""
    staging = checkpointer.StagingBlocks(pinned=False)
    views = staging.views([5, 7])
    assert staging.blocks == views and [v.numel() for v in views] == [5, 7]
    assert views[0].untyped_storage().data_ptr() != views[1].untyped_storage().data_ptr()
