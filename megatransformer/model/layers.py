"""Norms, feed-forward networks and the Transformer block (pre- or post-LN)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatransformer.config import ModelConfig
from megatransformer.model.attention import Attention, KVCache
from megatransformer.model.masks import AttentionMask
from megatransformer.model.positions import Alibi


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


class RMSNormFunction(torch.autograd.Function):
    """RMSNorm that keeps only its input and the per-row 1/rms for the backward pass.

    ``nn.RMSNorm`` on bf16 input keeps two fp32 copies of the activation for its backward (4x the bytes of
    the input; ~100 MiB of a 32M-parameter model's 512-token batch) and runs ~20 kernels for forward and
    backward; this one keeps the bf16 input, recomputes the rest in fp32 and needs half the time.
    Numerics as in Llama: ``weight * (x * rstd).to(x.dtype)``, statistics in fp32.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # one explicit upcast: mixed bf16/fp32 operands would each be converted by a hidden copy on CPU
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        rstd = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).square_().div_(x.shape[-1]).add_(eps).rsqrt_()
        ctx.save_for_backward(x, weight, rstd)
        x_hat = x32 * rstd if x32 is x else x32.mul_(rstd)
        return x_hat.to(x.dtype).mul_(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        x_hat = x.to(rstd.dtype).mul_(rstd) if x.dtype != rstd.dtype else x * rstd
        grad32 = grad.to(rstd.dtype)
        grad_weight = (grad32 * x_hat).flatten(0, -2).sum(0).to(weight.dtype)
        grad_hat = grad32.mul_(weight) if grad32 is not grad else grad32 * weight
        mean_dot = (grad_hat * x_hat).sum(-1, keepdim=True).div_(-x.shape[-1])
        grad_x = grad_hat.addcmul_(x_hat, mean_dot).mul_(rstd).to(x.dtype)
        return grad_x, grad_weight, None


class RMSNorm(nn.Module):
    """Root-mean-square norm with a learned scale (parameter ``weight``, as ``nn.RMSNorm``)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)


class FeedForward(nn.Module):
    """relu / gelu: down(act(up(x))); swiglu: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.kind = cfg.ffn
        if cfg.ffn == "swiglu":
            self.gate_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.d_ff, bias=cfg.bias)
        self.down_proj = nn.Linear(cfg.d_ff, cfg.d_model, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            hidden = F.silu(self.gate_proj(x)) * self.up_proj(x)
        elif self.kind == "gelu":
            hidden = F.gelu(self.up_proj(x))
        else:
            hidden = F.relu(self.up_proj(x))
        return self.down_proj(self.dropout(hidden))


class Block(nn.Module):
    """Self-attention, optional cross-attention (decoder of an encoder-decoder), feed-forward.

    Each sub-layer is wrapped as ``x + drop(f(norm(x)))`` (pre-LN) or ``norm(x + drop(f(x)))`` (post-LN).
    """

    def __init__(self, cfg: ModelConfig, cross_attention: bool = False) -> None:
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        attn = dict(
            d_model=cfg.d_model,
            n_heads=cfg.n_heads,
            n_kv_heads=cfg.kv_heads,
            bias=cfg.bias,
            dropout=cfg.attention_dropout,
            backend=cfg.attention_backend,
        )
        self.attn_norm = make_norm(cfg)
        self.self_attn = Attention(**attn)
        if cross_attention:
            self.cross_norm = make_norm(cfg)
            self.cross_attn = Attention(**attn)
        self.ffn_norm = make_norm(cfg)
        self.ffn = FeedForward(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def _residual(self, x: torch.Tensor, norm: nn.Module, fn) -> torch.Tensor:
        if self.pre_norm:
            return x + self.dropout(fn(norm(x)))
        return norm(x + self.dropout(fn(x)))

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
        memory: torch.Tensor | None = None,
        memory_mask: AttentionMask | None = None,
        cache: KVCache | None = None,
        memory_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
        alibi: Alibi | None = None,
    ) -> torch.Tensor:
        """``alibi`` biases self-attention only: decoder queries and encoder keys share no position axis."""
        x = self._residual(x, self.attn_norm, lambda h: self.self_attn(h, mask, rope, cache=cache, alibi=alibi))
        if memory is not None or memory_kv is not None:
            x = self._residual(
                x,
                self.cross_norm,
                lambda h: self.cross_attn(h, memory_mask, memory=memory, memory_kv=memory_kv),
            )
        return self._residual(x, self.ffn_norm, self.ffn)
