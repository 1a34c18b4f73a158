"""Which flash-attention core runs on a GPU: the speed table ``auto`` reads, what each core cannot do, and
flash-attn 4 / 3 through PyTorch's registry of flash implementations.

flash-attn 4 (``pip install --pre flash-attn-4``: ``flash_attn.cute``) and flash-attn 3 (flash-attn's ``hopper/``
build: ``flash_attn_interface``) are never called directly: PyTorch (>= 2.11) registers their kernels under
SDPA's flash backend and ``torch.nn.attention.varlen.varlen_attn`` when one is activated
(``torch.nn.attention.activate_flash_attention_impl``), and the model calls those two. Activation is global to
the process, so a process runs at most one of them (:func:`registry_core`). See docs/gpu.md.
"""

from __future__ import annotations

import functools
import importlib
import re
from dataclasses import dataclass

import torch

from megatransformer.model.compile_marks import constant_result

GENERATIONS = {8: "ampere", 9: "hopper", 10: "blackwell"}  # compute capability major -> generation
VARLEN_BACKENDS = frozenset({"auto", "flash", "fa3", "fa4", "varlen"})  # those whose GPU cores read varlen problems
MASK_KINDS = ("causal", "packed documents", "prefix-LM", "cross-attention", "window", "alibi")

# The cores ``auto`` tries, fastest first, per GPU generation and mask kind; the first one installed that can
# honour the call runs. "varlen" (PyTorch's own flash kernel for varlen problems) serves masks with segments or a
# prefix only, "sdpa" serves everything. flash-attn 3 is Hopper-only, flash-attn 4 runs on Hopper and Blackwell
# (torchtitan: FA3 on Hopper, FA4 on Blackwell); neither has ALiBi. flash-attn 4 ranks below PyTorch's varlen
# kernel for packed batches until measured: torch 2.13's registry calls its varlen backward without
# ``max_seqlen`` (a grid sized by the total tokens, mostly idle blocks), and since activation routes
# ``varlen_attn`` to it too, ``auto`` then does not activate it in a process at all (:func:`registry_skip`).
_PLAIN = {
    "ampere": ("flash", "sdpa"),
    "hopper": ("fa3", "fa4", "flash", "sdpa"),
    "blackwell": ("fa4", "flash", "sdpa"),
}
_VARLEN = {
    "ampere": ("flash", "varlen", "sdpa"),
    "hopper": ("fa3", "flash", "varlen", "fa4", "sdpa"),
    "blackwell": ("flash", "varlen", "fa4", "sdpa"),
}
SPEED_TABLE: dict[tuple[str, str], tuple[str, ...]] = {
    **{(generation, "causal"): cores for generation, cores in _PLAIN.items()},
    **{(generation, kind): cores for generation, cores in _VARLEN.items() for kind in MASK_KINDS[1:5]},
    **{(generation, "alibi"): ("flash", "sdpa") for generation in _PLAIN},
}

# The first PyTorch whose registry passes each core the windows ``varlen_attn`` gives it, and what goes wrong
# before it (read from torch 2.11 and 2.13, flash-attn-4 4.0.0b36; docs/gpu.md). One table, read by one
# resolver (:func:`torch_refusal`), for ``auto`` and for a named core alike.
REGISTRY_TORCH: dict[str, tuple[tuple[int, int], str]] = {
    "fa4": (
        (2, 13),
        "torch {version}'s varlen_attn passes flash-attn 4 the window (-1, 0): its registry rejects any window in "
        "the backward and flash-attn 4 reads -1 as a window with no keys in the forward (wrong outputs), so packed "
        "documents, prefix-LM and cross-attention fail",
    ),
    "fa3": (
        (2, 13),
        "torch {version}'s FA3 registration was not checked for the windows varlen_attn passes (torch 2.13's "
        "passes them right)",
    ),
}


@dataclass(frozen=True)
class RegistryImpl:
    """A flash implementation PyTorch's registry activates: its registry name, the module whose import shows
    it is installed, the GPU generations its kernels run on, the widest head and how to install it."""

    name: str
    module: str
    generations: frozenset[str]
    max_head_dim: int
    install: str


REGISTRY_IMPLS = {
    "fa4": RegistryImpl(
        "FA4", "flash_attn.cute.interface", frozenset({"hopper", "blackwell"}), 128, "pip install --pre flash-attn-4"
    ),
    "fa3": RegistryImpl(
        "FA3",
        "flash_attn_interface",
        frozenset({"hopper"}),
        256,
        "build flash-attn's hopper/ directory (python setup.py install there; no wheel on PyPI)",
    ),
}


def mask_kind(mask, alibi: bool = False, cross: bool = False) -> str:
    """The kind of a call's mask as the speed table names it (ALiBi first: it rules out most cores)."""
    if alibi:
        return "alibi"
    if mask is not None and mask.window is not None:
        return "window"
    if mask is not None and mask.prefix_len is not None:
        return "prefix-LM"
    if cross or (mask is not None and mask.kv_segments is not mask.q_segments):
        return "cross-attention"
    if mask is not None and mask.q_segments is not None:
        return "packed documents"
    return "causal"


# What ``auto`` asks of the machine is a constant of the process: compiled code takes it as one
# (``assume_constant_result``: called once while tracing, no import or CUDA query in the graph).


@constant_result
def gpu_generation() -> str | None:
    """This process's GPU generation, None without CUDA or for a generation the table does not know."""
    return _gpu_generation()


@functools.cache
def _gpu_generation() -> str | None:
    if not torch.cuda.is_available():
        return None
    return GENERATIONS.get(torch.cuda.get_device_capability()[0])


def registry_available() -> bool:
    """This PyTorch has the registry of flash implementations (2.11+)."""
    try:
        from torch.nn.attention import activate_flash_attention_impl, list_flash_attention_impls  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def registry_impl_installed(core: str) -> bool:
    """flash-attn 4 or 3 can be activated here: PyTorch registers it and its kernel module imports (a build for
    another torch or CUDA fails at import, and must not be chosen)."""
    impl = REGISTRY_IMPLS[core]
    if not registry_available():
        return False
    from torch.nn.attention import list_flash_attention_impls

    if impl.name not in list_flash_attention_impls():
        return False
    try:
        importlib.import_module(impl.module)
    except Exception:  # ImportError, OSError, undefined symbols: not usable here
        return False
    return True


def torch_version() -> tuple[int, int]:
    """This PyTorch's (major, minor), read at every call (the tests set ``torch.__version__``)."""
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return int(major), int(minor)


def torch_refusal(core: str) -> str | None:
    """Why this PyTorch must not run registry core ``core`` (one clause), or None where it passes windows right."""
    first, why = REGISTRY_TORCH[core]
    if torch_version() >= first:
        return None
    version = ".".join(map(str, torch_version()))
    return f"{why.format(version=version)}; it needs torch >= {'.'.join(map(str, first))}"


def registry_skip(core: str, generation: str) -> str | None:
    """Why ``auto`` does not activate an installed registry core on this GPU generation (one clause), or None.
    One core serves every call of a process (activation routes SDPA's flash backend and ``varlen_attn`` to it),
    so a core this PyTorch runs wrongly, or one the table ranks below PyTorch's varlen kernel for a mask kind, is
    not activated at all."""
    refused = torch_refusal(core)
    if refused is not None:
        return refused
    for kind in MASK_KINDS[1:5]:
        cores = SPEED_TABLE[(generation, kind)]
        if "varlen" in cores and cores.index("varlen") < cores.index(core):
            return (
                f"{core} ranks below PyTorch's varlen kernel for packed batches until measured (torch's registry "
                f"calls flash-attn {core[-1]}'s varlen backward without max_seqlen); "
                f"model.attention_backend={core} runs it"
            )
    return None


@constant_result
def registry_core(generation: str | None) -> str | None:
    """The registry core ``auto`` runs in this process: the first of the table's cores for ``generation`` that
    is installed and that ``auto`` may activate (:func:`registry_skip`); one choice serves every call."""
    if generation is None:
        return None
    for core in SPEED_TABLE[(generation, "causal")]:
        if (
            core in REGISTRY_IMPLS
            and generation in REGISTRY_IMPLS[core].generations
            and registry_impl_installed(core)
            and registry_skip(core, generation) is None
        ):
            return core
    return None


def active_impl() -> str | None:
    """The registry's active implementation ("FA4", "FA3"), None for PyTorch's own flash kernel."""
    if not registry_available():
        return None
    from torch.nn.attention import current_flash_attention_impl

    return current_flash_attention_impl()


_activated: str | None = None  # the implementation this module activated (read where compiled code runs)


def activate(core: str) -> None:
    """Route SDPA's flash backend and ``varlen_attn`` to flash-attn 4 or 3 (idempotent; before compiling: a
    compiled core only checks that it was)."""
    global _activated
    impl = REGISTRY_IMPLS[core].name
    if torch.compiler.is_compiling():
        if _activated != impl:
            raise RuntimeError(
                f"attention core {core} was not activated before compiling: call "
                "megatransformer.model.gpu_cores.activate_for(backend, device) first"
            )
        return
    if active_impl() != impl:
        from torch.nn.attention import activate_flash_attention_impl

        activate_flash_attention_impl(impl)
    _activated = impl


def activate_for(backend: str, device: str) -> str | None:
    """Activate the registry core a run's ``backend`` uses on ``device`` (a named fa3/fa4, or the one ``auto``
    picks); the core's name, or None when none is used."""
    if device != "cuda":
        return None
    core = backend if backend in REGISTRY_IMPLS else registry_core(gpu_generation()) if backend == "auto" else None
    if core is not None:
        activate(core)
    return core


def refusal(core: str, device: str, *, dropout: float, alibi: bool, dtype: torch.dtype) -> str | None:
    """Why a named registry core cannot run this model here (one line), or None."""
    impl = REGISTRY_IMPLS.get(core)
    if impl is None:
        return None
    what = f"model.attention_backend={core} (flash-attn {core[-1]} through PyTorch's flash registry)"
    if device != "cuda":
        return f"{what} needs a CUDA GPU, this machine has none; use model.attention_backend=auto"
    if not registry_available():
        return f"{what} needs PyTorch >= 2.11 (torch.nn.attention.activate_flash_attention_impl); use auto"
    refused = torch_refusal(core)
    if refused is not None:
        return f"{what} cannot run on this PyTorch: {refused}; upgrade torch or use auto"
    if not registry_impl_installed(core):
        return f"{what} is not installed here ({impl.module} does not import): {impl.install}, or use auto"
    generation = gpu_generation()
    if generation not in impl.generations:
        runs_on = " or ".join(sorted(impl.generations))
        return f"{what} runs on {runs_on} GPUs, this one is {generation or 'another generation'}; use auto"
    if alibi:
        return f"{what} has no ALiBi; use model.attention_backend=flash (flash-attn 2), sdpa or auto"
    if dropout:
        return f"{what} has no attention dropout; set model.attention_dropout=0 or use sdpa"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{what} runs in bf16 or fp16 only; set precision=bf16"
    return None
