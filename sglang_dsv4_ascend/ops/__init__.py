"""The one dispatcher for the DeepSeek-V4 hot ops, W8A8 included.

Model code calls ops through this package (`from sglang_dsv4_ascend import ops; ops.rms_norm(...)`),
never an implementation module. `kernels(family)` is the table of one kernel family:

* 'reference' - the plain-torch definitions everywhere (`reference.py`, `quant.py`;
  `SGLANG_DSV4_FORCE_REFERENCE=1`);
* 'cpu' - the reference, with its dispatch-bound mHC pieces run as TorchScript graphs
  (`scripted.py`) and W8A8 GEMMs on the fastest exact method for the machine (`quant.int8_method`);
* 'triton' (CUDA) - Triton kernels (`triton/`) for the sparse attention, the compressor pool and
  W8A8, the scripted mHC;
* 'npu' - torch_npu calls (`npu.py`) for RMSNorm, the sparse attention and W8A8.

An op without a faster implementation in a family is the reference. `ops.<hot op>` and
`ops.KERNEL_FAMILY` read the table of `device.kernel_family()`, decided on first use and kept for
the process (`active()`); the W8A8 modules take `kernels()` (the family now, or the one they are
given) when they are built. Nothing is bound at import: importing this package imports no
kernel module, and `kernels(family)` builds any family's table in process.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

from .. import device
from . import quant, reference

HOT_OPS = (
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
W8A8_OPS = ("prepare_weight", "dynamic_quant", "static_quant", "quant_matmul", "grouped_quant_matmul")
FAMILIES = ("reference", "cpu", "triton", "npu")


@dataclass(frozen=True)
class Kernels:
    """One kernel family's implementation of every op. `weight_layout` is what `prepare_weight`
    produces and what `quant_matmul` / `grouped_quant_matmul` expect: 'nk' (the checkpoint's
    [.., N, K]) or 'kn' (+ FRACTAL_NZ on the NPU); W8A8 modules call `prepare_weight` once after
    loading."""

    family: str
    # hot ops (reference.py is the definition)
    apply_rope: Callable
    block_pool: Callable
    mhc_mix: Callable
    mhc_weights: Callable
    pool_block_rows: Callable
    rms_norm: Callable
    rope_cos_sin: Callable
    sinkhorn: Callable
    softmax_pool: Callable
    sparse_attention_sources: Callable
    sparse_attention_with_sink: Callable
    sqrtsoftplus: Callable
    swiglu_clamped: Callable
    # W8A8 (quant.py is the definition)
    weight_layout: str
    prepare_weight: Callable
    dynamic_quant: Callable
    static_quant: Callable
    quant_matmul: Callable  # (xq, w, w_scale, x_scale=None, bias=None, out_dtype=bf16)
    grouped_quant_matmul: Callable  # (xq, w, scales, per_token, group_list, group_list_type, out_dtype)


def _contiguous(w):
    return w.contiguous()


def _build(family: str) -> Kernels:
    hot = {name: getattr(reference, name) for name in HOT_OPS}
    w8a8 = dict(
        weight_layout="nk",
        prepare_weight=_contiguous,
        dynamic_quant=quant.dynamic_quant,
        static_quant=quant.static_quant,
        quant_matmul=quant.quant_matmul,
        grouped_quant_matmul=quant.grouped_quant_matmul,
    )
    if family in ("cpu", "triton"):
        from . import scripted

        hot.update(mhc_weights=scripted.mhc_weights, sinkhorn=scripted.sinkhorn)
    if family == "triton":
        from .triton import quant as triton_quant
        from .triton.compress_pool import block_pool
        from .triton.sparse_attention import sparse_attention_sources, sparse_attention_with_sink

        hot.update(
            sparse_attention_with_sink=sparse_attention_with_sink,
            sparse_attention_sources=sparse_attention_sources,
            block_pool=block_pool,
        )
        w8a8.update(dynamic_quant=triton_quant.dynamic_quant, quant_matmul=triton_quant.quant_matmul)
    if family == "npu":
        from . import npu  # never imports torch_npu itself: its functions do, when called

        hot.update(
            rms_norm=npu.rms_norm,
            sparse_attention_with_sink=npu.sparse_attention_with_sink,
            sparse_attention_sources=npu.sparse_attention_sources,
        )
        w8a8 = dict(
            weight_layout="kn",
            prepare_weight=npu.prepare_weight,
            dynamic_quant=npu.dynamic_quant,
            static_quant=npu.static_quant,
            quant_matmul=npu.quant_matmul,
            grouped_quant_matmul=npu.grouped_quant_matmul,
        )
    return Kernels(family=family, **hot, **w8a8)


@functools.lru_cache(maxsize=None)
def _cached(family: str) -> Kernels:
    return _build(family)


def kernels(family: str | None = None) -> Kernels:
    """The op table of `family` (one of FAMILIES); None = `device.kernel_family()` now
    (SGLANG_DSV4_FORCE_REFERENCE=1 -> 'reference')."""
    if family is None:
        family = device.kernel_family()
    if family not in FAMILIES:
        raise ValueError(f"unknown kernel family {family!r}; expected one of {sorted(FAMILIES)}")
    return _cached(family)


@functools.lru_cache(maxsize=1)
def active() -> Kernels:
    """The table the hot ops run from in this process: `device.kernel_family()`'s, decided on the
    first op call."""
    return kernels()


def __getattr__(name: str):
    if name in HOT_OPS:
        return getattr(active(), name)
    if name == "KERNEL_FAMILY":
        return active().family
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(HOT_OPS) + ["KERNEL_FAMILY"])


__all__ = ["FAMILIES", "HOT_OPS", "Kernels", "active", "kernels", *HOT_OPS]
