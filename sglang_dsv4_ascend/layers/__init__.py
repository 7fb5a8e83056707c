"""DeepSeek-V4 building blocks, one file per component (see docs/dsv4_reference.md §1).

Layers call hot ops through the `sglang_dsv4_ascend.ops` namespace (`ops.rms_norm(...)`) so that a
device dispatch, or a test, can rebind them in one place.
"""

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..ops.reference import pad_rows

# An fp32 CPU matmul of fewer rows than this takes gemv / small-M kernels whose reduction order
# differs from the blocked gemm's (measured, AVX512: M <= 3 differs from M >= 4 on every shape
# of this model; bf16 matmuls agree at every M).
SMALL_M = 4


class Linear(nn.Linear):
    """nn.Linear whose every row gets the same bits whatever the batch: fp32 inputs of fewer than
    SMALL_M rows are computed on rows padded to 16 (ops.reference.pad_rows), so a one-row decode
    rounds as the same row inside a verify or a larger batch. A request's tokens must not depend
    on what else the server is running (the speculative engine's losslessness and greedy
    reproducibility rest on it). Other platforms' kernels are their own: unverified there."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.dim() == 2 and 0 < x.shape[0] < SMALL_M:
            return F.linear(pad_rows(x), self.weight, self.bias)[: x.shape[0]]
        return super().forward(x)


class RMSNorm(nn.Module):
    """Weighted RMSNorm; the parameter is named `weight` like the released `*.norm.weight` tensors."""

    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)
