"""Position information: sinusoidal and learned absolute embeddings, rotary embeddings (RoPE).

All take explicit ``position_ids`` so that packed documents restart at 0 and cached decoding continues
where the prompt ended.
"""

from __future__ import annotations

import math

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
        return 1.0 / (self.theta ** exponents)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        angles = position_ids.unsqueeze(-1).float() * self.inv_freq(position_ids.device)  # [B, T, D/2]
        angles = torch.cat([angles, angles], dim=-1).unsqueeze(1)  # [B, 1, T, D]
        return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate [B, H, T, D] queries or keys by the angles of their positions."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin
