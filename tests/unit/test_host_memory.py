"""train.host_memory's policy line: what it says on other C libraries, when glibc refuses, for an unknown
policy (its effect on page faults: tests/e2e/test_host_memory_faults.py)."""

from __future__ import annotations

import ctypes
import platform

import pytest

from megatransformer.training.runtime.host_memory import apply_host_memory_policy


def test_other_c_libraries_are_told_not_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert apply_host_memory_policy("keep") == (
        "host memory: keep has no effect with this C library (glibc only); its defaults apply"
    )


def test_a_refused_mallopt_is_said_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    class Libc:  # glibc whose mallopt answers 0 (refused) to every call
        def __init__(self) -> None:
            self.mallopt = lambda parameter, value: 0

    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    assert apply_host_memory_policy("keep") == "host memory: keep was refused by glibc's mallopt; its defaults apply"


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="choose from"):
        apply_host_memory_policy("cache")
