"""Rotary tables for V4's two rope flavours (reference §1.4 "RoPE").

* "main" (SWA-only layers, drafts): inv_freq_i = theta^(-2i/rd), theta = rope_theta.
* "compress" (layers with a compressor): theta = compress_rope_theta with YaRN frequency correction
  (NTK-by-parts): frequencies whose wavelength exceeds the original context are divided by `factor`,
  short ones are kept, a linear ramp blends the band between the beta_fast/beta_slow correction dims.
  No YaRN attention-magnitude factor (attention_factor = 1.0), as in the official code and HF.

The arithmetic follows transformers' `_compute_default_rope_parameters` / `_compute_yarn_parameters`
step by step (fp32, same operation order) so that the tables are bit-identical to the oracle.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .. import ops
from ..config import RopeParams


def inv_freq_for(p: RopeParams) -> torch.Tensor:
    """[rd/2] fp32 inverse frequencies for one rope flavour."""
    dim, base = p.dim, p.theta
    exponents = torch.arange(0, dim, 2, dtype=torch.float) / dim
    if not p.yarn:
        return 1.0 / (base**exponents)
    pos_freqs = base**exponents
    extrapolation = 1.0 / pos_freqs  # original frequencies (kept for short wavelengths)
    interpolation = 1.0 / (p.factor * pos_freqs)  # stretched frequencies (long wavelengths)

    def correction_dim(num_rotations):
        # the rotary pair index whose wavelength fits `num_rotations` times into the original context
        return (dim * math.log(p.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(p.beta_fast), correction_dim(p.beta_slow)
    if p.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1 -> original frequency, 0 -> interpolated
    return interpolation * (1 - keep) + extrapolation * keep


class Rotary(nn.Module):
    """cos/sin for absolute positions; the table is a non-persistent buffer (never in checkpoints)."""

    def __init__(self, p: RopeParams, device=None):
        super().__init__()
        self.params = p
        self.register_buffer("inv_freq", inv_freq_for(p).to(device), persistent=False)

    def forward(self, positions: torch.Tensor):
        return ops.rope_cos_sin(positions, self.inv_freq, self.params.attention_factor)
