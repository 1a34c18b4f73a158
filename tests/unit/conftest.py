"""Fixtures of the unit tests."""

import os

import pytest
import torch
from support import flash_reference

from megatransformer.model import attention

if "OMP_NUM_THREADS" not in os.environ:  # (which decides, as for the trainer)
    torch.set_num_threads(1)  # tiny tensors: more threads only wait for each other, and for a busy machine's cores


@pytest.fixture
def reference_flash(monkeypatch):
    """flash_core on tests/support/flash_reference.py: flash-attn's documented contract, on CPU."""
    monkeypatch.setattr(attention, "flash_attn_module", lambda: flash_reference.MODULE)


@pytest.fixture(autouse=True)
def flex_uncompiled(monkeypatch):
    """flex_core runs FlexAttention's eager reference here (its masks and score_mods as plain functions, the math
    the tests compare), without dynamo and Inductor (a C++ compilation of minutes on a first run);
    tests/e2e/test_flex_compiled.py checks the compiled kernel."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True)
    monkeypatch.setattr(attention, "_compiled_flex", flex.flex_attention)
