"""Fixtures of the unit tests."""

import pytest

from megatransformer.model import attention
from support import flash_reference


@pytest.fixture
def reference_flash(monkeypatch):
    """flash_core on tests/support/flash_reference.py: flash-attn's documented contract, on CPU."""
    monkeypatch.setattr(attention, "flash_attn_module", lambda: flash_reference.MODULE)
