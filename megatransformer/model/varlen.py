"""Varlen attention: a mask's varlen problems (:meth:`masks.AttentionMask.varlen_problems`) run through a
flash kernel over the flattened batch, and the core on PyTorch's own kernel
(``torch.nn.attention.varlen.varlen_attn``) for GPUs without the flash-attn package."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

from megatransformer.model.compile_marks import constant_result
from megatransformer.model.masks import AttentionMask, VarlenProblem

# kernel(q, k, v, problem) -> out; q: [total_q, H, D], k, v: [total_k, Hkv, D] -> [total_q, H, D]
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, VarlenProblem], torch.Tensor]


def varlen_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask, kernel: VarlenKernel
) -> torch.Tensor:
    """Attention under ``mask`` as one kernel call per varlen problem; q: [B, H, Tq, D]; k, v: [B, Hkv, Tk, D]
    -> [B, H, Tq, D]."""
    batch, heads, q_len, dim = q.shape
    q, k, v = (t.transpose(1, 2).flatten(0, 1) for t in (q, k, v))  # [B * T, H, D]
    out = None
    for problem in mask.varlen_problems(batch, q_len, k.shape[0] // batch):
        part = kernel(_gather(q, problem.q_index), _gather(k, problem.k_index), _gather(v, problem.k_index), problem)
        if problem.q_index is None:  # the problem holds every query in order
            out = part
        else:
            out = (q.new_zeros(q.shape) if out is None else out).index_copy(0, problem.q_index, part)
    return out.view(batch, q_len, heads, dim).transpose(1, 2)


def window_size(window: int | None, causal: bool) -> tuple[int, int]:
    """flash-attn's (and varlen_attn's) ``window_size=(left, right)``: query i sees keys i - left ... i + right
    (bottom-right aligned; -1: unbounded), for a mask's sliding ``window`` and causality."""
    left = -1 if window is None else window - 1
    return left, 0 if causal else left


def _gather(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    return x if index is None else x.index_select(0, index)


def torch_varlen_core(q, k, v, mask: AttentionMask, dropout: float, alibi=None) -> torch.Tensor:
    """PyTorch's flash kernel for packed documents, prefix-LM and packed cross-attention (CUDA, fp16/bf16,
    head dim <= 256); causal problems are bottom-right aligned, as flash-attn's. The kernel has neither
    attention dropout nor ALiBi."""
    from torch.nn.attention.varlen import varlen_attn

    if dropout or alibi is not None:
        raise ValueError("PyTorch's varlen_attn has no attention dropout or ALiBi; use attention_backend=sdpa")

    takes_gqa = "enable_gqa" in varlen_attn_keywords()

    def kernel(q, k, v, problem: VarlenProblem) -> torch.Tensor:
        gqa = {}
        if q.shape[1] != k.shape[1]:
            if takes_gqa:
                gqa = {"enable_gqa": True}
            else:  # (PyTorch 2.11's kernel has no GQA: each kv head repeated for its group of query heads)
                k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        window = window_size(mask.window, problem.causal)
        return varlen_attn(q, k, v, problem.cu_q, problem.cu_k, problem.max_q, problem.max_k, window_size=window, **gqa)

    return varlen_attention(q, k, v, mask, kernel)


def varlen_attn_keywords() -> frozenset[str]:
    """The keyword arguments this PyTorch's ``varlen_attn`` takes (none where it has none): ``window_size``
    from 2.11 on (2.10 has only ``is_causal``), ``enable_gqa`` after 2.11."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return frozenset()
    return _keywords(varlen_attn)


@functools.cache
def _keywords(function: Callable) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


@constant_result  # (a constant of the process, read by compiled code as one)
def torch_varlen_available() -> bool:
    """This PyTorch's ``varlen_attn`` takes a ``window_size`` (2.11+) and its flash kernel runs on this GPU
    (compute capability 8.0+)."""
    return _torch_varlen_available()


@functools.cache
def _torch_varlen_available() -> bool:
    if "window_size" not in varlen_attn_keywords():
        return False
    return torch.backends.cuda.is_flash_attention_available() and torch.cuda.get_device_capability() >= (8, 0)


torch_varlen_available.cache_clear = _torch_varlen_available.cache_clear
