"""Fixtures of the unit tests."""

import pytest
from support import flash_reference

from megatransformer.model import attention


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
