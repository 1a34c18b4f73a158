"""flash-attn's two entry points over ``flash_reference`` as a PyTorch custom op, opaque to ``torch.compile`` as
flash-attn's own ops are: compiled graphs on CPU then hold everything ``flash_core`` does around the kernel."""

from __future__ import annotations

import torch

from support import flash_reference


@torch.library.custom_op("megatransformer_tests::varlen_reference", mutates_args=())
def varlen_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_q: torch.Tensor,
    cu_k: torch.Tensor,
    max_q: int,
    max_k: int,
    causal: bool,
) -> torch.Tensor:
    return flash_reference.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, causal=causal)


@varlen_reference.register_fake
def _(q, k, v, cu_q, cu_k, max_q, max_k, causal):
    return q.new_empty(q.shape)


def _varlen_backward(ctx, grad):
    q, k, v, cu_q, cu_k = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = flash_reference.flash_attn_varlen_func(q, k, v, cu_q, cu_k, ctx.max_q, ctx.max_k, causal=ctx.causal)
        grads = torch.autograd.grad(out, (q, k, v), grad)
    return (*grads, None, None, None, None, None)


def _varlen_setup(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, causal = inputs
    ctx.save_for_backward(q, k, v, cu_q, cu_k)
    ctx.max_q, ctx.max_k, ctx.causal = max_q, max_k, causal


varlen_reference.register_autograd(_varlen_backward, setup_context=_varlen_setup)


def flash_varlen_op(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, causal=False):
    return varlen_reference(q, k, v, cu_q, cu_k, max_q, max_k, causal)


def flash_dense_op(q, k, v, dropout_p=0.0, causal=False):
    batch, q_len, k_len = q.shape[0], q.shape[1], k.shape[1]
    cu_q = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32)
    cu_k = torch.arange(0, (batch + 1) * k_len, k_len, dtype=torch.int32)
    out = varlen_reference(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, q_len, k_len, causal)
    return out.view(q.shape)


FLASH_OPS = type(flash_reference.MODULE)(flash_attn_func=flash_dense_op, flash_attn_varlen_func=flash_varlen_op)
