"""The training process's host memory policy: memory it frees stays with it for the next step, once the run has
started.

Under glibc's defaults, malloc serves every block above its mmap threshold (128 KiB at first, raised to at
most 32 MiB as such blocks are freed) with fresh pages from the kernel, returns them on free, and trims the
free top of its heap. A training step allocates and frees the same tensors every step, so every step pays a
page fault per 4 KiB of many of them: ~100,000 faults and ~15% of a bf16 CPU step of a 26M-parameter
model (BENCHMARKS.md, section 5e). On a GPU, PyTorch's caching allocator keeps device memory for reuse;
PyTorch's CPU launcher (``torch.backends.xeon.run_cpu``) gets the same on the host by preloading jemalloc
or tcmalloc. Two ``mallopt`` calls give it without a preload: no mmap for large blocks (they come from the
heap, which grows once to the step's peak) and no trimming. The price: the process keeps its peak host
memory until it exits, as it would with a caching allocator.

The start (the model's construction, the engine's start, a checkpoint's load) frees large blocks once, in sizes
that never recur, between blocks it keeps (ZeRO-3's partitions): from the heap they left holes that no later block
fit, and the heap grew by about the whole model's transients (8 ranks, ZeRO-3, a 99M decoder of 40 layers: 259
MiB at the end of the construction against a 24 MiB partition). So until the first step every large block is
mapped on its own and returned when freed, and the policy applies from the first step on.
"""

from __future__ import annotations

import ctypes
import platform
import typing

from megatransformer.config import TrainConfig

POLICIES = typing.get_args(TrainConfig.model_fields["host_memory"].annotation)  # ("keep", "release")

# mallopt's parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
INT_MAX = 2**31 - 1
LARGE_BLOCK = 128 * 1024  # glibc's initial mmap threshold, fixed: it no longer rises to the largest block freed


def mallopt():
    """glibc's ``mallopt`` (answers 1 on success), or None with another C library."""
    libc_name, _ = platform.libc_ver()
    call = getattr(ctypes.CDLL(None), "mallopt", None) if libc_name == "glibc" else None
    if call is not None:
        call.argtypes, call.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return call


def map_large_blocks() -> bool:
    """Serve every block of 128 KiB or more with pages of its own, returned to the kernel when it is freed (glibc's
    threshold fixed at its initial value; by default it rises up to 32 MiB as such blocks are freed, and blocks below
    it come from the heap). The start's setting; False where glibc is not the C library or refuses it."""
    call = mallopt()
    return call is not None and bool(call(M_MMAP_THRESHOLD, LARGE_BLOCK))


def apply_host_memory_policy(policy: str) -> str:
    """Apply ``train.host_memory`` to this process (and the loader workers it starts) from the first step on, after
    :func:`map_large_blocks` served the start; returns the run log's line.

    ``keep``: large blocks come from the heap, never from mmap, and the heap is trimmed only when more than
    2 GiB lie free at its top. ``release``: every large block is mapped on its own and returned when freed, as
    during the start. Other C libraries: nothing changes (the line says so).
    """
    if policy not in POLICIES:
        raise ValueError(f"host memory policy {policy!r}: choose from {POLICIES}")
    call = mallopt()
    if call is None:
        libc_name, _ = platform.libc_ver()
        return (
            f"host memory: {policy} has no effect with {libc_name or 'this C library'} (glibc only); its defaults apply"
        )
    if policy == "release":
        if not call(M_MMAP_THRESHOLD, LARGE_BLOCK):
            return "host memory: release was refused by glibc's mallopt; its defaults apply"
        return "host memory: release (glibc malloc: each block of 128 KiB or more mapped alone, returned when freed)"
    if not (call(M_MMAP_MAX, 0) and call(M_TRIM_THRESHOLD, INT_MAX)):
        return "host memory: keep was refused by glibc's mallopt; its defaults apply"
    return "host memory: keep (glibc malloc: large blocks from the heap, no trimming; the process holds its peak)"


def return_free_memory() -> None:
    """Hand the free pages of glibc's heap back to the kernel (``malloc_trim``): the start-up's transient
    buffers (ZeRO-3's construction gathers a parameter at a time) would otherwise stay resident under ``keep``."""
    libc_name, _ = platform.libc_ver()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None) if libc_name == "glibc" else None
    if trim is not None:
        trim.argtypes, trim.restype = (ctypes.c_size_t,), ctypes.c_int
        trim(0)
