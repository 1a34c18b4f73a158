"""Position information: sinusoidal and learned absolute embeddings, rotary embeddings (RoPE), ALiBi.

All take explicit ``position_ids`` so that packed documents restart at 0 and cached decoding continues
where the prompt ended.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn


def sinusoidal_table(max_len: int, dim: int) -> torch.Tensor:
    """The 2017 paper's PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
    position = torch.arange(max_len, dtype=torch.float32).unsqueeze(1)
    div = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(max_len, dim)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div)
    return table


class SinusoidalPositions(nn.Module):
    def __init__(self, max_len: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("table", sinusoidal_table(max_len, dim), persistent=False)

    def reset_buffers(self) -> None:
        """The table made again, in fp32 on its device (a build that casts every tensor made in it to the run's
        precision made it in bf16)."""
        self.table = sinusoidal_table(*self.table.shape).to(self.table.device)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.table[position_ids]


class LearnedPositions(nn.Module):
    def __init__(self, max_len: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max_len, dim))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.weight[position_ids]


class Rotary(nn.Module):
    """cos/sin of the rotary angles for given positions (half-split layout, as in Llama).

    The frequencies are computed in fp32 on every call (head_dim / 2 numbers), not kept as a buffer: an
    engine that casts the module to bf16 casts its buffers too, and bf16 frequencies put positions a few
    hundred tokens apart at visibly wrong angles.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponents)

    def frequencies(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The inverse frequencies for these positions and the scale of cos/sin (plain RoPE: 1; see
        :mod:`rope_scaling` for the scaled kinds)."""
        return self.inv_freq(position_ids.device), 1.0

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq, scale = self.frequencies(position_ids)
        angles = position_ids.unsqueeze(-1).float() * inv_freq  # [B, T, D/2]
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [B, 1, T, D]
        cos, sin = angles.cos(), angles.sin()
        if scale != 1.0:
            cos, sin = cos * scale, sin * scale
        return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, H, T, D] queries or keys by the angles of their positions, in x's dtype.

    Under autocast the projections come out in the autocast dtype while cos/sin stay in the weights' fp32:
    the rotation is computed in fp32 and rounded back, so queries and keys keep the values' dtype.
    """
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


# ------------------------------------------------------------------------------------------- ALiBi


def alibi_slopes(n_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al. 2022), fp32 [n_heads].

    For n heads a power of two: 2^(-8i/n) for i = 1..n. Otherwise the slopes of the closest smaller power of
    two c, then every other slope of 2c (its odd i) until there are n. Built on ``device`` with device ops,
    not as a buffer: an engine that casts the module to bf16 would round the slopes too (2^-0.5 is not a
    bf16 number), and a host list copied in would make the host wait.
    """
    closest = 1 << (n_heads.bit_length() - 1)
    exponents = torch.cat(
        [
            torch.arange(1, closest + 1, dtype=torch.float32, device=device),
            torch.arange(n_heads - closest, dtype=torch.float32, device=device) + 0.5,  # odd i of 2c, halved
        ]
    )
    return torch.exp2(exponents * (-8.0 / closest))


@dataclass(frozen=True)
class Alibi:
    """ALiBi's additive attention bias for one attention call: ``-slopes[h] * |q_pos - k_pos|``.

    Positions are the model's ``position_ids`` (packed documents restart at 0, cached decoding continues), so
    the bias is a function of the distance within a document. Causal masks only allow ``k_pos <= q_pos``,
    where this is the paper's ``-m * (i - j)``; bidirectional attention (encoders, the prefix of a prefix-LM)
    uses the distance both ways, the usual symmetric extension and what flash-attn computes for its
    non-causal ``alibi_slopes``. There is no position table: any length works.
    """

    slopes: torch.Tensor  # fp32 [H]: one per query head of this call
    q_positions: torch.Tensor  # [B, Tq]
    k_positions: torch.Tensor  # [B, Tk]

    def heads(self, start: int, count: int) -> Alibi:
        """The bias of query heads start:start + count (a tensor-parallel shard of the heads)."""
        if start == 0 and count == len(self.slopes):
            return self
        return replace(self, slopes=self.slopes[start : start + count])

    def with_keys(self, k_positions: torch.Tensor) -> Alibi:
        return replace(self, k_positions=k_positions)

    def bias(self, q_start: int = 0, q_end: int | None = None, kv_len: int | None = None) -> torch.Tensor:
        """fp32 [B, H, rows, Tk] for query rows q_start:q_end and the first ``kv_len`` keys (all by default)."""
        q_pos = self.q_positions[:, q_start:q_end]
        k_pos = self.k_positions[:, :kv_len]
        distance = (q_pos.unsqueeze(-1) - k_pos.unsqueeze(-2)).abs().unsqueeze(1)  # [B, 1, rows, Tk]
        return distance * -self.slopes.view(1, -1, 1, 1)

    def score_mod(self):
        """The same bias as a FlexAttention ``score_mod(score, b, h, q_idx, kv_idx)``."""
        slopes, q_positions, k_positions = self.slopes, self.q_positions, self.k_positions

        def mod(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_positions[b, q_idx] - k_positions[b, kv_idx]).abs()

        return mod
