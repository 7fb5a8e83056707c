"""Single import point for the DeepSeek-V4 hot ops.

Model code imports ops from here (`from sglang_dsv4_ascend import ops; ops.rms_norm(...)`), never
from an implementation module. Each name is bound once, at import, to the implementation of the
kernel family `device.kernel_family()` picks: the plain-torch reference (`reference.py`, the
definition, `SGLANG_DSV4_FORCE_REFERENCE=1`), the reference with its dispatch-bound pieces run
as TorchScript graphs on CPU (`scripted.py`), Triton kernels on CUDA (`triton/`), or torch_npu
calls on Ascend (`npu.py`). Ops without a faster implementation for the active family
stay the reference.
"""

from __future__ import annotations

from .. import device
from . import reference

_NAMES = (
    "apply_rope",
    "block_pool",
    "mhc_mix",
    "mhc_weights",
    "pool_block_rows",
    "rms_norm",
    "rope_cos_sin",
    "sinkhorn",
    "softmax_pool",
    "sparse_attention_sources",
    "sparse_attention_with_sink",
    "sqrtsoftplus",
    "swiglu_clamped",
)


def _faster(family: str) -> dict:
    """{op name: implementation} that replace the reference for `family` (imported lazily)."""
    if family in ("cpu", "triton"):
        from . import scripted

        out = {"mhc_weights": scripted.mhc_weights, "sinkhorn": scripted.sinkhorn}
        if family == "triton":
            from .triton.sparse_attention import sparse_attention_sources, sparse_attention_with_sink

            out["sparse_attention_with_sink"] = sparse_attention_with_sink
            out["sparse_attention_sources"] = sparse_attention_sources
            from .triton.compress_pool import block_pool

            out["block_pool"] = block_pool
        return out
    if family == "npu":
        from . import npu

        return {"rms_norm": npu.rms_norm, "sparse_attention_with_sink": npu.sparse_attention_with_sink,
                "sparse_attention_sources": npu.sparse_attention_sources}
    return {}


KERNEL_FAMILY = device.kernel_family()
IMPLEMENTATIONS = {name: getattr(reference, name) for name in _NAMES}
IMPLEMENTATIONS.update(_faster(KERNEL_FAMILY))
globals().update(IMPLEMENTATIONS)

__all__ = list(_NAMES)
