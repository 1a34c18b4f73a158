"""What the training step decides around the model: compilation by device, the garbage collector's schedule,
selective activation checkpointing, DeepSpeed's overlapped gradient reduction."""

from __future__ import annotations

import gc

import pytest
import torch
from support.models import run_config, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from megatransformer.model import build_model
from megatransformer.training.collector import GarbageCollection
from megatransformer.training.engine.compiled import compile_blocks, compile_enabled, describe_compile
from megatransformer.training.engine.train_module import deepspeed_config
from megatransformer.training.runtime.layout import BatchSizes


@pytest.mark.parametrize(
    "setting, device, compiled",
    [(None, "cuda", True), (None, "cpu", False), (True, "cpu", True), (False, "cuda", False)],
)
def test_compile_defaults_to_on_for_cuda_and_off_on_cpus(setting, device, compiled):
    cfg = run_config(train={"compile": setting})
    assert compile_enabled(cfg, device) is compiled
    line = describe_compile(cfg, device)
    assert line.startswith("torch.compile: " + ("each Transformer block" if compiled else "off"))
    assert ("train.compile" if setting is not None else f"default on {device.upper()}") in line


def test_blocks_compile_in_place_with_their_parameter_names():
    model = build_model(tiny_config())
    names = [name for name, _ in model.named_parameters()]
    assert compile_blocks(model) == 2
    assert [name for name, _ in model.named_parameters()] == names
    assert all(block._compiled_call_impl is not None for block in model.decoder.layers)


def test_the_collector_is_frozen_and_runs_every_n_steps(monkeypatch):
    collected = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collected.append(args) or real_collect(*args))
    collector = GarbageCollection(every=3)
    try:
        assert not gc.isenabled() and gc.get_freeze_count() > 0
        collected.clear()
        for step in range(1, 8):
            collector.step(step)
        assert len(collected) == 2  # after steps 3 and 6
    finally:
        collector.close()
    assert gc.isenabled() and gc.get_freeze_count() == 0


def test_gc_every_zero_leaves_pythons_schedule():
    collector = GarbageCollection(every=0)
    assert gc.isenabled() and gc.get_freeze_count() == 0
    collector.close()


class CountMatmuls(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def backward_matmuls(checkpointing, backend: str = "sdpa") -> tuple[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = build_model(tiny_config(activation_checkpointing=checkpointing, attention_backend=backend)).train()
    ids = torch.randint(0, 97, (2, 12))
    loss = model(input_ids=ids, labels=ids)
    with CountMatmuls() as counter:
        loss.backward()
    return counter.count, [p.grad for p in model.parameters()]


def test_selective_checkpointing_recomputes_no_matmul_and_gives_the_same_gradients():
    plain, plain_grads = backward_matmuls(False)
    selective, selective_grads = backward_matmuls("selective")
    whole, _ = backward_matmuls(True)
    assert selective == plain < whole  # (per block: the forward's matmuls run again)
    for got, want in zip(selective_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want)


def test_selective_checkpointing_recomputes_the_chunked_core_and_gives_the_same_gradients():
    """The CPU's core masks its chunks' scores in place: kept by the selective policy, they would be a cached
    product mutated (an error in the backward), and every chunk's scores kept (the memory the core saves)."""
    plain, plain_grads = backward_matmuls(False, "chunked")
    selective, selective_grads = backward_matmuls("selective", "chunked")
    whole, _ = backward_matmuls(True, "chunked")
    assert plain < selective < whole  # (the core's products run again, the projections' do not)
    for got, want in zip(selective_grads, plain_grads, strict=True):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize(
    "stage, device, dp, overlapped",
    [(1, "cuda", 2, True), (2, "cuda", 8, True), (2, "cpu", 2, False), (1, "cuda", 1, False), (3, "cuda", 2, None)],
)
def test_gradient_reduction_overlaps_the_backward_for_zero_1_and_2_on_several_gpus(stage, device, dp, overlapped):
    cfg = run_config(parallel={"zero_stage": stage})
    ds = deepspeed_config(cfg, BatchSizes(2, 1, dp), device, zero_stage=stage)
    assert ds["zero_optimization"].get("overlap_comm") is overlapped
