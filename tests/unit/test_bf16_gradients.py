"""bf16 gradients are summed over micro batches and reduced over ranks in fp32: the DeepSpeed config says so,
and the run log says where DeepSpeed cannot (ZeRO-0)."""

from __future__ import annotations

import pytest
from support.models import run_config

from megatransformer.training.engine.train_module import deepspeed_config
from megatransformer.training.runtime.layout import BatchSizes, zero_stage_notes


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_bf16_configs_accumulate_and_reduce_in_fp32(zero):
    ds = deepspeed_config(run_config(precision="bf16"), BatchSizes(2, 8, 2), "cpu", zero_stage=zero)
    assert ds["communication_data_type"] == "fp32"
    assert ds.get("data_types") == (None if zero == 0 else {"grad_accum_dtype": "fp32"})  # (ZeRO-0 cannot)
    fp32 = deepspeed_config(run_config(), BatchSizes(2, 8, 2), "cpu", zero_stage=zero)
    assert "data_types" not in fp32 and "communication_data_type" not in fp32


def test_the_run_log_says_when_bf16_gradients_accumulate_in_bf16():
    zero0 = run_config(precision="bf16", parallel=dict(zero_stage=0), train=dict(grad_accum=8))
    assert "accumulates gradients over micro batches in bf16" in " ".join(zero_stage_notes(zero0, 0, "cpu"))
    zero1 = run_config(precision="bf16", parallel=dict(zero_stage=1), train=dict(grad_accum=8))
    assert zero_stage_notes(zero1, 1, "cpu") == []
