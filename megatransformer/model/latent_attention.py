"""Multi-head latent attention (MLA, DeepSeek-V2/V3), with the attention cores of :mod:`attention`.

Keys and values of all heads are up-projected (``kv_b_proj``) from one latent per token (``kv_a_proj``, then
``kv_a_norm``); RoPE rotates a separate slice of each head, whose key is one per token, shared by all heads.
Training and prompts run the up-projected form: a plain multi-head core call. A KV cache holds the latent and
the RoPE key only, and calls onto held tokens (decoding) run the absorbed form: ``kv_b_proj``'s key half folded
into the queries, its value half applied after the core, which then attends over the latent as one key/value
head. Both compute the same function (docs/attention.md).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatransformer.config import ModelConfig
from megatransformer.model.attention import BACKENDS, KVCache
from megatransformer.model.masks import AttentionMask
from megatransformer.model.norms import RMSNorm
from megatransformer.model.positions import apply_rope

LATENT_NORM_EPS = 1e-6  # DeepSeek's latent norms keep their own epsilon, not the model's
TAKES_VALUE_DIM = ("sdpa", "eager", "flex")
"""Cores that take values of another width than queries and keys; the others get zero-padded values."""


def unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def pads_values(backend: str) -> bool:
    return backend not in TAKES_VALUE_DIM


def core_head_dim(cfg: ModelConfig) -> int:
    """The head width the attention cores of a training forward see (after any padding)."""
    if cfg.attention != "mla":
        return cfg.head_dim
    return max(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim)


def describe_value_width(cfg: ModelConfig) -> str:
    """One line for the run log: how the attention cores take MLA's value heads."""
    qk_dim, v_dim, backend = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.attention_backend
    cached = f"cached decoding attends over the {cfg.kv_lora_rank}-wide latent as one key/value head"
    widths = f"values {v_dim} wide beside queries/keys {qk_dim}"
    if qk_dim == v_dim:
        return f"attention: mla, query/key and value heads {qk_dim} wide; {cached}"
    if not pads_values(backend):
        return f"attention: mla, {widths}, taken as they are by {backend}; {cached}"
    padded = "values zero-padded to" if v_dim < qk_dim else "queries/keys zero-padded to"
    return (
        f"attention: mla, {widths}: {padded} {max(qk_dim, v_dim)} for "
        f"{backend} (its cores take one head width), the padding's outputs dropped; {cached}"
    )


class LatentAttention(nn.Module):
    """Self-attention with a compressed key/value latent. The number of heads is read from the up-projections'
    width, so a tensor-parallel shard holding a slice of the heads of ``q_proj``/``q_b_proj``, ``kv_b_proj``
    and ``o_proj`` runs this code unchanged (the latent projections are whole on every rank)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        heads, d_model = cfg.n_heads, cfg.d_model
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent_dim = cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d_model, heads * qk_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(d_model, cfg.q_lora_rank, bias=cfg.bias)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, eps=LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, heads * qk_dim, bias=False)
        self.kv_a_proj = nn.Linear(d_model, self.latent_dim + self.rope_dim, bias=cfg.bias)
        self.kv_a_norm = RMSNorm(self.latent_dim, eps=LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(self.latent_dim, heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(heads * self.v_dim, d_model, bias=cfg.bias)
        self.dropout = cfg.attention_dropout
        self.core = BACKENDS[cfg.attention_backend]
        self.pad_values = pads_values(cfg.attention_backend)
        # the RoPE key on its way to this shard's heads: unchanged, or under tensor parallelism through an op that
        # sums its gradient over the shards, whose heads all read it (set by the training engine)
        self.shared_key = unchanged

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        return q.view(x.shape[0], x.shape[1], -1, self.nope_dim + self.rope_dim).transpose(1, 2)

    def forward(
        self,
        x: torch.Tensor,
        mask: AttentionMask,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache | None = None,
        alibi: None = None,  # (the block passes ALiBi's bias, which MLA never has: it needs position=rope)
    ) -> torch.Tensor:
        """``cache``: append this call's latent and RoPE key; a call onto tokens held before attends over
        them all in the absorbed form."""
        batch, length = x.shape[:2]
        q_nope, q_rot = self._queries(x).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rot = self.kv_a_proj(x).split([self.latent_dim, self.rope_dim], dim=-1)
        latent = self.kv_a_norm(latent).unsqueeze(1)  # [B, 1, T, latent]: one key/value "head"
        k_rot = self.shared_key(k_rot).unsqueeze(1)  # [B, 1, T, rope]
        q_rot, k_rot = apply_rope(q_rot, *rope), apply_rope(k_rot, *rope)
        held = 0
        if cache is not None:
            held = cache.length
            latent, k_rot, _ = cache.append(latent, k_rot)
        if held == 0:  # (a prompt, or no cache: its many queries are cheaper against up-projected keys)
            out = self._expanded(q_nope, q_rot, latent, k_rot, mask)
        else:
            out = self._absorbed(q_nope, q_rot, latent, k_rot, mask)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))

    def _expanded(self, q_nope, q_rot, latent, k_rot, mask: AttentionMask) -> torch.Tensor:
        """Keys and values up-projected for every head: [B, H, T, nope + v] from the latent."""
        kv = self.kv_b_proj(latent.squeeze(1))
        kv = kv.view(*kv.shape[:2], -1, self.nope_dim + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        return self._attend(torch.cat([q_nope, q_rot], dim=-1), k, v, mask)

    def _absorbed(self, q_nope, q_rot, latent, k_rot, mask: AttentionMask) -> torch.Tensor:
        """q_nope . (W_k c) = (W_k^T q_nope) . c: queries moved into the latent space, one key/value head (the
        latent, with the RoPE key beside it), the value up-projection applied to the core's output. The queries
        are scaled so that the core's 1/sqrt(width) is 1/sqrt(nope + rope), the up-projected form's."""
        weight = self.kv_b_proj.weight.view(-1, self.nope_dim + self.v_dim, self.latent_dim)
        w_k, w_v = weight.split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.einsum("bhtn,hnc->bhtc", q_nope, w_k.to(q_nope.dtype))
        width = self.latent_dim + self.rope_dim
        q = torch.cat([q_latent, q_rot], dim=-1) * math.sqrt(width / (self.nope_dim + self.rope_dim))
        out = self._attend(q, torch.cat([latent, k_rot], dim=-1), latent, mask)
        return torch.einsum("bhtc,hvc->bhtv", out, w_v.to(out.dtype))

    def _attend(self, q, k, v, mask: AttentionMask) -> torch.Tensor:
        """The core on values of another width than q/k: zero-padded to it for the cores that need one width
        (the padding's outputs are zeros, dropped); queries and keys padded instead where values are wider,
        the queries scaled to keep the scores' 1/sqrt(width)."""
        qk_dim, v_dim = q.shape[-1], v.shape[-1]
        if self.pad_values and v_dim < qk_dim:
            v = F.pad(v, (0, qk_dim - v_dim))
        elif self.pad_values and v_dim > qk_dim:
            q = F.pad(q * math.sqrt(v_dim / qk_dim), (0, v_dim - qk_dim))
            k = F.pad(k, (0, v_dim - qk_dim))
        out = self.core(q, k, v, mask, self.dropout if self.training else 0.0, None)
        return out[..., :v_dim] if out.shape[-1] != v_dim else out
