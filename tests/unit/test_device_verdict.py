"""The verdict on an update taken on the device: PyTorch's fused AdamW skipping by it without a host read, the
schedule held back for the verdict's reader; the spike limits the device compares with, the ladder's own
decisions; the staged copy a step's statistics are read from a step later."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support.host_reads import counting_host_reads

from megatransformer.config import SpikesConfig
from megatransformer.training.engine.staged import StagedCopy
from megatransformer.training.engine.train_module import gated_update
from megatransformer.training.observability.spikes import SpikeLadder


def fused_engine():
    """A parameter with a gradient, its fused AdamW and schedule, wrapped as ZeRO wraps them."""
    param = torch.nn.Parameter(torch.ones(3))
    inner = torch.optim.AdamW([param], lr=0.1, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(inner, lambda step: 1.0 / (step + 1))
    param.grad = torch.ones(3)
    return param, inner, scheduler, SimpleNamespace(optimizer=SimpleNamespace(optimizer=inner), lr_scheduler=scheduler)


def test_a_device_verdict_skips_in_the_kernel_without_a_read_and_holds_the_schedule_back(recwarn):
    param, inner, scheduler, engine = fused_engine()
    with counting_host_reads() as reads, gated_update(engine, lambda: torch.tensor(False)):
        inner.step()
        scheduler.step()
    assert reads.count == 0
    assert torch.equal(param.detach(), torch.ones(3)) and float(inner.state[param]["step"]) == 0
    assert not inner.state[param]["exp_avg"].any() and not inner.state[param]["exp_avg_sq"].any()
    assert scheduler.last_epoch == 0 and not hasattr(inner, "found_inf")
    with counting_host_reads() as reads, gated_update(engine, lambda: torch.tensor(True)):
        inner.step()
        scheduler.step()
    assert reads.count == 0
    assert not torch.equal(param.detach(), torch.ones(3)) and float(inner.state[param]["step"]) == 1
    assert scheduler.last_epoch == 0  # (moved on by whoever reads the verdict)
    assert not recwarn.list


def test_a_skipped_then_applied_update_equals_the_applied_one_alone():
    """Weights and moments after a skip-by-kernel and an update are those of the update alone."""
    param, inner, _, engine = fused_engine()
    with gated_update(engine, lambda: torch.tensor(False)):
        param.grad = torch.full((3,), math.nan)
        inner.step()
    with gated_update(engine, lambda: torch.tensor(True)):
        param.grad = torch.ones(3)
        inner.step()
    reference, plain, _, _ = fused_engine()
    plain.step()
    assert torch.equal(param.detach(), reference.detach())
    for key in ("step", "exp_avg", "exp_avg_sq"):
        assert torch.equal(inner.state[param][key], plain.state[reference][key])


@pytest.mark.parametrize("grad_norm", [False, True])
def test_the_limits_reject_what_the_ladder_rejects(grad_norm):
    """A finite step exceeds a limit exactly when the ladder rejects it, through warm-up and after."""
    cfg = SpikesConfig(window=8, warmup=4, threshold=1.0, min_rise=0.01, grad_norm=grad_norm, grad_norm_threshold=1.0)
    ladder, twin = SpikeLadder(cfg), SpikeLadder(cfg)
    rng = np.random.default_rng(0)
    decisions = set()
    for loss, norm in zip(3 + 0.3 * rng.standard_normal(300), 1 + 0.3 * rng.standard_normal(300), strict=True):
        loss_limit, norm_limit = ladder.limits()
        beyond = loss > loss_limit or norm > norm_limit
        assert beyond == ladder.rejects(loss, norm)
        decisions.add(beyond)
        twin.rejects(loss, norm)
    assert decisions == {False, True} and ladder.state_dict() == twin.state_dict()
    assert SpikeLadder(cfg.model_copy(update={"enabled": False})).limits() == (math.inf, math.inf)
    assert SpikeLadder(cfg).limits() == (math.inf, math.inf)  # (warming up)


def test_a_staged_copy_on_a_cpu_is_read_without_a_counted_read():
    values = torch.tensor([1.5, math.nan, 3.0], dtype=torch.float64)
    with counting_host_reads() as reads:
        staged = StagedCopy().stage(values)
        got = staged.values()
    assert reads.count == 0 and got[0] == 1.5 and math.isnan(got[1]) and got[2] == 3.0


@pytest.mark.gpu
def test_a_staged_copy_on_cuda_arrives_through_page_locked_memory():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    copies = StagedCopy()
    for n in range(3):
        staged = copies.stage(torch.arange(4, dtype=torch.float64, device="cuda") * n)
        assert staged.host.is_pinned() and staged.values() == [0.0, n, 2.0 * n, 3.0 * n]
