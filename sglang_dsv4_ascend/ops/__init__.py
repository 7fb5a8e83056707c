"""Single import point for the DeepSeek-V4 hot ops.

Model code imports ops from here (`from sglang_dsv4_ascend.ops import rms_norm`), never from an
implementation module, so a device dispatch can later rebind these names to fused kernels. Today
every name is the plain-torch reference in `ops/reference.py`.
"""

from .reference import (
    apply_rope,
    mhc_mix,
    mhc_weights,
    rms_norm,
    rope_cos_sin,
    sinkhorn,
    softmax_pool,
    sparse_attention_with_sink,
    sqrtsoftplus,
    swiglu_clamped,
)

__all__ = [
    "apply_rope",
    "mhc_mix",
    "mhc_weights",
    "rms_norm",
    "rope_cos_sin",
    "sinkhorn",
    "softmax_pool",
    "sparse_attention_with_sink",
    "sqrtsoftplus",
    "swiglu_clamped",
]
