"""RoPE scaling for context extension: the rotary frequencies of ``model.rope_scaling``.

The formulas and their parameters are those of transformers' ``modeling_rope_utils`` (rope types linear,
dynamic, yarn and llama3), so an exported model computes the same angles. Everything is computed on the
device from fp32 numbers on every call, as :class:`positions.Rotary` does; nothing waits for the host.
"""

from __future__ import annotations

import math

import torch

from megatransformer.config import ModelConfig, RopeScaling
from megatransformer.model.positions import Rotary


class ScaledRotary(Rotary):
    """Rotary angles with scaled frequencies."""

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling) -> None:
        super().__init__(head_dim, theta)
        self.scaling = scaling

    def frequencies(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, float]:
        scaling, inv_freq = self.scaling, self.inv_freq(position_ids.device)
        if scaling.type == "linear":
            return inv_freq / scaling.factor, 1.0
        if scaling.type == "dynamic":
            return self._dynamic(position_ids), 1.0
        if scaling.type == "yarn":
            return _yarn(inv_freq, scaling, self.head_dim, self.theta), _yarn_attention_factor(scaling)
        return _llama3(inv_freq, scaling), 1.0

    def _dynamic(self, position_ids: torch.Tensor) -> torch.Tensor:
        """NTK-aware: the base grows with the longest position of the call beyond the trained length."""
        factor, dim, trained = self.scaling.factor, self.head_dim, self.scaling.original_max_seq_len
        length = (position_ids.max() + 1).clamp(min=trained).float()
        base = self.theta * (factor * length / trained - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.float32, device=position_ids.device) / dim
        return 1.0 / base**exponents


def rotary(cfg: ModelConfig) -> Rotary:
    """The rotary embedding a rope model's config describes (of the RoPE slice of each head under MLA)."""
    dim = cfg.qk_rope_head_dim if cfg.attention == "mla" else cfg.head_dim
    if cfg.rope_scaling is None:
        return Rotary(dim, cfg.rope_theta)
    return ScaledRotary(dim, cfg.rope_theta, cfg.rope_scaling)


def _yarn_attention_factor(scaling: RopeScaling) -> float:
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    return 1.0 if scaling.factor <= 1 else 0.1 * math.log(scaling.factor) + 1.0


def _yarn(inv_freq: torch.Tensor, scaling: RopeScaling, dim: int, theta: float) -> torch.Tensor:
    """Interpolated (divided by factor) below beta_slow rotations per original context, extrapolated (kept)
    above beta_fast, a linear ramp over the dimensions between."""

    def correction_dim(rotations: float) -> float:
        return dim * math.log(scaling.original_max_seq_len / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers does: no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=inv_freq.device) - low) / (high - low)).clamp(0, 1)
    return inv_freq / scaling.factor * ramp + inv_freq * (1 - ramp)


def _llama3(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Wavelengths below original / high_freq_factor kept, above original / low_freq_factor divided by
    factor, a smooth blend between."""
    original, factor = scaling.original_max_seq_len, scaling.factor
    wavelength = 2 * math.pi / inv_freq
    smooth = (original / wavelength - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > original / scaling.low_freq_factor, inv_freq / factor, blended)
    return torch.where(wavelength < original / scaling.high_freq_factor, inv_freq, scaled)
