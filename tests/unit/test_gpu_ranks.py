"""A rank's GPU and its end, on a CPU: the device a rank takes where Slurm shows each task one GPU (a faked
device count), the device eval and generate run on, and whether its process groups are ended after a failed
collective (a faked backend name)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed

from megatransformer.training.runtime import distributed


@pytest.mark.parametrize("local_rank, count", [(0, 1), (0, 8), (3, 8), (7, 8)])
def test_a_rank_takes_its_local_rank_where_that_device_exists(local_rank, count):
    assert distributed.cuda_device(local_rank, count) == (local_rank, None)


def test_slurms_one_gpu_per_task_gives_every_rank_the_one_it_sees_and_says_so(monkeypatch, capsys):
    """``--gpus-per-task=1``: each task sees its GPU as device 0; LOCAL_RANK 3 is no device there."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    assert distributed.select_cuda_device(3) == 0 and chosen == [0]
    line = capsys.readouterr().out.strip()
    assert line == (
        "device: local rank 3 sees 1 GPU (CUDA_VISIBLE_DEVICES=3: Slurm's --gpus-per-task or --gpu-bind binds each "
        "task to its own); using cuda:0 (local_rank % device_count)"
    )
    # DeepSpeed's zero.Init and engine take the device from LOCAL_RANK: now the device's index
    assert os.environ["LOCAL_RANK"] == "0"
    assert distributed.select_cuda_device(0) == 0 and capsys.readouterr().out == ""  # rank 0: nothing to say


def test_a_rank_whose_local_rank_is_a_device_here_keeps_it(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    assert distributed.select_cuda_device(3) == 3 and os.environ["LOCAL_RANK"] == "3"


def test_fewer_gpus_than_local_ranks_wrap_around_and_warn_that_nccl_refuses_shared_gpus():
    index, line = distributed.cuda_device(5, 2)
    assert index == 1 and "using cuda:1" in line and "ranks that share a GPU fail under NCCL" in line


@pytest.mark.parametrize(
    "cuda, local_rank, device", [(False, "1", "cpu"), (True, "1", "cuda:1"), (True, "3", "cuda:1")]
)
def test_eval_and_generate_run_on_the_ranks_gpu_as_training_picks_it_or_on_the_cpu(
    monkeypatch, cuda, local_rank, device
):
    from megatransformer.inference import inference_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    said: list[str] = []
    assert inference_device(said.append) == device
    assert said == ([distributed.cuda_device(3, 2)[1]] if local_rank == "3" else [])
    assert os.environ["LOCAL_RANK"] == ("1" if local_rank == "3" else local_rank)  # (DeepSpeed's device, too)


@pytest.mark.parametrize(
    "initialized, backend, ends",
    [
        (True, "gloo", True),  # the groups end at once, the process as a finished one
        (True, "nccl", False),  # may wait on the peer that is gone: left as they are
        (True, "cpu:gloo,cuda:nccl", False),  # a group with NCCL in it: left too
        (False, "gloo", False),  # no group to end
    ],
)
def test_after_a_failed_collective_only_gloos_groups_are_ended(monkeypatch, initialized, backend, ends):
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: initialized)
    monkeypatch.setattr(torch.distributed, "get_backend", lambda group=None: backend)
    assert distributed.groups_end_after_failure() is ends
