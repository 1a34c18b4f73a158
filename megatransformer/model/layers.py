"""Norms, feed-forward networks and the Transformer block (pre- or post-LN)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megatransformer.config import ModelConfig
from megatransformer.model.attention import Attention, KVCache
from megatransformer.model.latent_attention import LatentAttention
from megatransformer.model.masks import AttentionMask
from megatransformer.model.norms import RMSNorm
from megatransformer.model.positions import Alibi


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, eps=cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.bias)


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
            qk_norm_eps=cfg.norm_eps if cfg.qk_norm else None,
        )
        self.attn_norm = make_norm(cfg)
        self.self_attn = LatentAttention(cfg) if cfg.attention == "mla" else Attention(**attn)
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
