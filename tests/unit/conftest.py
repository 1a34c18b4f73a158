"""Fixtures of the unit tests."""

import os
import warnings

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
def flex_without_inductor(monkeypatch):
    """flex_core runs FlexAttention unfused here: the same masks and score_mods, traced by dynamo as the compiled
    kernel's are, without Inductor's C++ compilation (minutes on a first run); tests/e2e/test_flex_compiled.py
    checks the compiled kernel."""
    from torch.nn.attention.flex_attention import flex_attention

    def unfused_flex(*args, **kwargs):
        with warnings.catch_warnings():  # (that it is unfused, which is meant here)
            warnings.filterwarnings("ignore", "flex_attention called without torch.compile", UserWarning)
            return flex_attention(*args, **kwargs)

    monkeypatch.setattr(attention, "_compiled_flex", unfused_flex)
