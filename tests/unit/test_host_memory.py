"""train.host_memory's policy line and glibc settings: what it says on other C libraries, when glibc refuses, for
an unknown policy; the start's setting (their effects on memory: tests/e2e/test_host_memory_faults.py)."""

from __future__ import annotations

import ctypes
import platform

import pytest

from megatransformer.training.runtime.host_memory import (
    M_MMAP_MAX,
    M_MMAP_THRESHOLD,
    M_TRIM_THRESHOLD,
    apply_host_memory_policy,
    map_large_blocks,
)


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


class RecordingLibc:
    """glibc whose mallopt records its calls and answers 1 (accepted)."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int]] = []
        self.mallopt = lambda parameter, value: self.calls.append((parameter, value)) or 1


def test_the_start_and_release_map_large_blocks_at_a_fixed_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    libc = RecordingLibc()
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    monkeypatch.setattr(ctypes, "CDLL", lambda name: libc)
    assert map_large_blocks()
    assert apply_host_memory_policy("release").startswith("host memory: release (glibc malloc: each block")
    assert libc.calls == [(M_MMAP_THRESHOLD, 128 * 1024)] * 2
    libc.calls.clear()
    assert apply_host_memory_policy("keep").startswith("host memory: keep (glibc malloc")
    assert libc.calls == [(M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, 2**31 - 1)]


def test_the_start_leaves_other_c_libraries_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert not map_large_blocks()
