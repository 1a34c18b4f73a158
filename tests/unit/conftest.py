"""Fixtures of the unit tests."""

import pytest
from support import flash_reference

from megatransformer.model import attention


@pytest.fixture
def reference_flash(monkeypatch):
    """flash_core on tests/support/flash_reference.py: flash-attn's documented contract, on CPU."""
    monkeypatch.setattr(attention, "flash_attn_module", lambda: flash_reference.MODULE)
