"""DeepSeek-V4 building blocks, one file per component (see docs/dsv4_reference.md §1).

Layers call hot ops through the `sglang_dsv4_ascend.ops` namespace (`ops.rms_norm(...)`) so that a
device dispatch, or a test, can rebind them in one place.
"""

import torch
from torch import nn

from .. import ops


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the parameter is named `weight` like the released `*.norm.weight` tensors."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)
