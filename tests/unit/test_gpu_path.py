"""The GPU path's parts that a CPU can check: the install the README prescribes, flash-attn's arguments by
name, and the real-kernel tests' helpers keeping every tensor on the kernel's device."""

from __future__ import annotations

import re

import torch
from support import REPO
from support.attention import SELF_MASKS, qkv, values_and_grads

from megatransformer.model import attention
from megatransformer.model.attention import eager_core, flash_core


def test_the_gpu_extra_holds_only_what_pip_installs_and_the_readme_adds_flash_attn_as_its_authors_say():
    """flash-attn's sdist imports torch in setup.py: pip's isolated build of an extra cannot build it."""
    from setuptools.config.pyprojecttoml import read_configuration

    project = read_configuration(REPO / "pyproject.toml")["project"]
    requirements = [*project["dependencies"], *sum(project["optional-dependencies"].values(), [])]
    assert not [r for r in requirements if re.match(r"flash[-_]attn", r)]
    assert set(project["optional-dependencies"]["gpu"]) == {"packaging", "ninja"}  # its build prerequisites
    readme = (REPO / "README.md").read_text()
    assert "pip install -e '.[gpu]'\npip install flash-attn --no-build-isolation\n" in readme
    assert attention.FLASH_ATTN_INSTALL == "pip install flash-attn --no-build-isolation"


def test_flash_attn_gets_dropout_by_name(monkeypatch):
    """FA3's fourth positional argument is softmax_scale: nothing but q, k, v (and varlen's lengths) by
    position."""
    seen = []

    def record(name):
        def kernel(*args, **kwargs):
            seen.append((name, len(args), kwargs["dropout_p"]))
            return torch.zeros_like(args[0])

        return kernel

    flash = type(
        "FlashAttn",
        (),
        {"flash_attn_func": staticmethod(record("dense")), "flash_attn_varlen_func": staticmethod(record("varlen"))},
    )
    monkeypatch.setattr(attention, "flash_attn_module", lambda: flash)
    q, k, v = qkv()
    flash_core(q, k, v, SELF_MASKS["causal"](), 0.25)
    flash_core(q, k, v, SELF_MASKS["packed_causal"](), 0.25)
    assert seen == [("dense", 3, 0.25), ("varlen", 7, 0.25)]


def test_the_real_kernel_helpers_keep_every_tensor_on_the_kernels_device():
    """On "meta" (which, like CUDA, refuses a CPU tensor in its ops) as the GPU tests run them on CUDA."""
    for name in ("causal", "packed_prefix_per_document"):
        mask = SELF_MASKS[name]().to("meta")
        q, k, v = (t.detach().to("meta").requires_grad_() for t in qkv())
        out, grads = values_and_grads(eager_core, q, k, v, mask)
        assert {t.device.type for t in (out, *grads)} == {"meta"}
