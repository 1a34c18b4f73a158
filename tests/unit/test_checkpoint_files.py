"""Checkpoint files without a run: DeepSpeed's state classes through the safe loader, torn metrics lines."""

from __future__ import annotations

import pytest
import torch

from megatransformer import checkpoint as ckpt
from megatransformer.checkpoint import integrity
from megatransformer.config import ConfigError
from megatransformer.training import checkpointer


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
    from megatransformer.training.metrics import truncate_metrics

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n{"step": 3, "lo')
    truncate_metrics(path, after_step=2)
    assert path.read_text() == '{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.0}\n'
    assert "the last line" in capsys.readouterr().err
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "lo\n{"step": 3, "loss": 1.0}\n')
    with pytest.raises(ConfigError, match="line 2 is not JSON"):
        truncate_metrics(path, after_step=2)
