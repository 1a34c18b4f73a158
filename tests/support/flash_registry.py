"""Fake flash-attn 4 / 3 implementations registered through PyTorch's own registry API
(``torch.nn.attention.register_flash_attention_impl``), their kernel modules stand-ins in ``sys.modules``, so
that ``gpu_cores`` finds them installed and activates them on a machine without CUDA."""

from __future__ import annotations

import sys
import types

import torch.nn.attention

from megatransformer.model import gpu_cores

MODULES = {"FA4": "flash_attn.cute.interface", "FA3": "flash_attn_interface"}
TORCH_REGISTER = {
    "FA4": torch.nn.attention._fa4.register_flash_attention_fa4,
    "FA3": torch.nn.attention._fa3.register_flash_attention_fa3,
}


class FakeHandle:
    """What an activation keeps alive; its removal is logged as ``-NAME``."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def remove(self) -> None:
        self.log.append(f"-{self.name}")


def register_fake(monkeypatch, name: str, log: list[str]) -> None:
    """Register a fake ``name`` ("FA4", "FA3") whose activation appends ``name`` to ``log``."""
    module = types.ModuleType(MODULES[name])
    module._flash_attn_fwd = module._flash_attn_bwd = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, MODULES[name], module)

    def register():
        log.append(name)
        return FakeHandle(log, name)

    torch.nn.attention.register_flash_attention_impl(name, register_fn=register)
    gpu_cores.registry_impl_installed.cache_clear()


def restore_torch_impls() -> None:
    """PyTorch's own registrations back, none active."""
    torch.nn.attention.restore_flash_attention_impl(_raise_warn=False)
    gpu_cores._activated = None
    for name, register in TORCH_REGISTER.items():
        torch.nn.attention.register_flash_attention_impl(name, register_fn=register)
    gpu_cores.registry_impl_installed.cache_clear()
