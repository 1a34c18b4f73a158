"""torch.compile's marks, set without importing dynamo: ``torch.compiler.assume_constant_result`` and
``torch.compiler.disable`` import it as they decorate (~1.5 s of the start of ``eval``, ``generate``, ``export``
and ``plan``, which never compile; a training process loads it with its optimizer). Both are checked against
torch's own decorators (tests/unit/test_compile_marks.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

F = TypeVar("F", bound=Callable)

# the attribute torch.compiler.assume_constant_result sets (torch/_dynamo/decorators.py, torch 2.5-2.13)
CONSTANT_MARK = "_dynamo_marked_constant"


def constant_result(fn: F) -> F:
    """``torch.compiler.assume_constant_result(fn)``: compiled code calls ``fn`` once, while tracing, and takes its
    result as a constant."""
    setattr(fn, CONSTANT_MARK, True)
    return fn


def never_compiled(fn: F) -> F:
    """``torch.compiler.disable(fn)``, dynamo imported at the first call (``torch._disable_dynamo``, DeepSpeed's
    ``lazy_disable`` too): compiled code breaks its graph around ``fn``, which runs eagerly."""
    return torch._disable_dynamo(fn)
