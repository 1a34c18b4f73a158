"""The partition map of DeepSpeed's fused fp16 optimizer at ZeRO-0 (FP16_Optimizer: one flat fp32 master per group,
which DeepSpeed builds only around its own FusedAdam, a CUDA op), built here around a torch AdamW on the CPU: each
parameter lies whole in its group's master, one after another, and the checkpointer's views and the weights made
from the masters read them there. The other layouts: tests/e2e/test_partition_map.py."""

from __future__ import annotations

import types

import torch

from megatransformer.checkpoint import sharded
from megatransformer.training.checkpointing.checkpointer import local_fragments
from megatransformer.training.deepspeed.masters import weights_from_masters
from megatransformer.training.deepspeed.partitions import Fragment, build_partition_map


def fused_fp16_engine():
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2)).half()
    groups = [{"params": [model[0].weight, model[1].weight]}, {"params": [model[0].bias, model[1].bias]}]
    inner = torch.optim.AdamW(groups, weight_decay=0.0)  # (its first step, on zero gradients, changes nothing)
    return types.SimpleNamespace(module=model, optimizer=FP16_Optimizer(inner, deepspeed=None)), inner


def test_fused_fp16_masters_hold_each_parameter_whole_one_after_another():
    engine, inner = fused_fp16_engine()
    partitions = build_partition_map(engine, inner, 0, 0)
    assert partitions.fragments == (
        Fragment(0, 0, "0.weight", 0, 12, 0, 0),
        Fragment(0, 0, "1.weight", 0, 8, 0, 12),
        Fragment(0, 0, "0.bias", 0, 4, 1, 0),
        Fragment(0, 0, "1.bias", 0, 2, 1, 4),
    )
    assert partitions.groups == (0, 1) and [t.numel() for t in partitions.tensors] == [20, 6]
    params = dict(engine.module.named_parameters())
    fragments = local_fragments(engine, partitions, 1)
    assert [f.coordinates for f in fragments] == [(name, 0, 0, p.numel()) for name, p in params.items()]
    for fragment in fragments:
        assert torch.equal(fragment.view(sharded.MASTER), params[fragment.name].float().reshape(-1))
        assert fragment.view("exp_avg").numel() == fragment.stop and fragment.view("momentum_buffer") is None
        fragment.view(sharded.MASTER).fill_(0.5)
        fragment.view("exp_avg").fill_(0.25)
    assert all(torch.all(inner.state[flat]["exp_avg"] == 0.25) for flat in partitions.tensors)
    weights_from_masters(engine, partitions)
    assert all(torch.all(p == 0.5) for p in params.values())
