"""A rank's generator states, saved and restored where another number of CUDA devices is visible (a fake of
torch.cuda's RNG API: this machine has no GPU)."""

from __future__ import annotations

import pytest
import torch

from megatransformer.training.checkpointing.rng import rng_state, set_rng_state


class FakeCudaRng:
    """torch.cuda's RNG functions over ``count`` visible devices, the current one ``current``; like the real
    ones, ``set_rng_state_all`` fails on more states than devices."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int, current: int = 0) -> None:
        self.states = [torch.full((16,), 10 * count + i, dtype=torch.uint8) for i in range(count)]
        self.current = current
        for name in (
            "is_available",
            "device_count",
            "current_device",
            "get_rng_state",
            "set_rng_state",
            "get_rng_state_all",
            "set_rng_state_all",
        ):
            monkeypatch.setattr(torch.cuda, name, getattr(self, name))

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return len(self.states)

    def current_device(self) -> int:
        return self.current

    def get_rng_state(self, device="cuda") -> torch.Tensor:
        return self.states[self.current].clone()

    def set_rng_state(self, state: torch.Tensor, device="cuda") -> None:
        self.states[self.current] = state.clone()

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.states]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        for i, state in enumerate(states):
            self.states[i] = state.clone()  # IndexError past the visible devices, as default_generators[i]


def test_resume_with_fewer_visible_devices_restores_the_ranks_own_device(monkeypatch):
    saving = FakeCudaRng(monkeypatch, count=4, current=2)  # a node showing every GPU to every rank
    state = rng_state()
    assert torch.equal(state["cuda"], saving.states[2])

    resuming = FakeCudaRng(monkeypatch, count=1)  # one GPU per task (Slurm's binding), or another node shape
    set_rng_state(state)
    assert torch.equal(resuming.states[0], saving.states[2])


def test_checkpoints_holding_every_devices_state_still_load(monkeypatch):
    old = [torch.full((16,), 100 + i, dtype=torch.uint8) for i in range(4)]
    state = {**rng_state(), "cuda": old}

    same_node = FakeCudaRng(monkeypatch, count=4, current=3)
    set_rng_state(state)
    assert torch.equal(same_node.states[3], old[3])

    one_device = FakeCudaRng(monkeypatch, count=1)
    set_rng_state(state)
    assert torch.equal(one_device.states[0], old[0])


def test_a_state_saved_without_cuda_leaves_the_devices_alone(monkeypatch):
    state = rng_state()  # the real torch.cuda here: no CUDA
    assert state["cuda"] is None
    cuda = FakeCudaRng(monkeypatch, count=2, current=1)
    before = cuda.get_rng_state_all()
    set_rng_state(state)
    assert all(torch.equal(a, b) for a, b in zip(cuda.states, before))
