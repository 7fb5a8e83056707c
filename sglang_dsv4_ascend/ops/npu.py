"""torch_npu calls for the W8A8 ops: the 'npu' kernel family of `ops/quant.py`.

UNVERIFIED ON NPU HARDWARE: nothing in this file has ever been run on an Ascend NPU by this
project. The calls follow the op-plugin documentation and SGLang 0.5.23's NPU linear / MoE methods
(docs/dsv4_reference.md §4.3, §4.4); tests/device/test_npu_w8a8.py compares each one with the
plain-torch reference and is skipped where torch_npu is not installed.

Not mapped yet: the batched attention (`ops.reference.sparse_attention_sources`). SGLang's NPU
DeepSeek-V4 backend runs it as `torch.ops.custom.npu_sparse_attn_sharedkv` over its paged SWA and
compressed-KV pools with block tables; our cache keeps per-request SWA rings and an entry store
addressed through token slots, so the mapping needs that layout (or a gather into it) first. On an
NPU the reference op runs, as on CPU.

Tree verify (speculative/engine.py) needs nothing more of that op than the chain does: each
root-to-leaf path is its own segment, so every query row's key list is still "its request's
committed rows + the earlier rows of its own segment", the per-row index lists the plan builds.
`npu_sparse_attn_sharedkv` takes explicit per-query index lists, so the same lists (or, computing
each node once, lists naming only the node's ancestors) are what a mapping would pass. Unwritten and
unverified on NPU hardware.

`torch_npu` is imported inside each function, never at module import: importing it without CANN
breaks `import torch`, and this module is imported on CPU machines too.

Weight layout: `prepare_weight` turns the checkpoint's int8 [.., N, K] into [.., K, N] contiguous and
casts it to FRACTAL_NZ (ACL format 29), as SGLang's `process_weights_after_loading` does; the matmuls
below take that layout.
"""

from __future__ import annotations

from typing import Optional

import torch

ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29


def _torch_npu():
    import torch_npu  # noqa: F401  (lazy: needs CANN)

    return torch_npu


def format_cast_nz(t: torch.Tensor) -> torch.Tensor:
    """ND -> FRACTAL_NZ (pure relayout). Unverified on NPU hardware: never run on an NPU by this project."""
    return _torch_npu().npu_format_cast(t, ACL_FORMAT_FRACTAL_NZ)


def prepare_weight(w: torch.Tensor) -> torch.Tensor:
    """Checkpoint int8 [.., N, K] -> [.., K, N] contiguous in FRACTAL_NZ, done once at load.
    Unverified on NPU hardware: never run on an NPU by this project."""
    return format_cast_nz(w.transpose(-2, -1).contiguous())


def dynamic_quant(x: torch.Tensor, smooth: Optional[torch.Tensor] = None):
    """npu_dynamic_quant(x[, smooth_scales]) -> (int8, fp32 per-row scale).
    Unverified on NPU hardware: never run on an NPU by this project (all-zero rows in particular)."""
    tnpu = _torch_npu()
    if smooth is None:
        return tnpu.npu_dynamic_quant(x)
    return tnpu.npu_dynamic_quant(x, smooth_scales=smooth)


def static_quant(x: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor,
                 param_dtype=torch.bfloat16) -> torch.Tensor:
    """npu_quantize(x, P(1/P(scale)) expanded to K, P(offset) expanded to K, qint8, axis=-1,
    div_mode=False), P = parameter dtype, as SGLang's NPUW8A8Int8LinearMethod. The expansion is
    recomputed per call here (cheap); a serving path would cache it at load.
    Unverified on NPU hardware: never run on an NPU by this project."""
    K = x.shape[-1]
    s = input_scale.to(param_dtype).reshape(-1)
    recip = (1 / s).expand(K).contiguous() if s.numel() == 1 else (1 / s)
    off = input_offset.to(param_dtype).reshape(-1)
    off = off.expand(K).contiguous() if off.numel() == 1 else off
    return _torch_npu().npu_quantize(x, recip, off, torch.qint8, -1, False)


def quant_matmul(xq: torch.Tensor, w_kn: torch.Tensor, w_scale: torch.Tensor, x_scale: Optional[torch.Tensor] = None,
                 bias: Optional[torch.Tensor] = None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """npu_quant_matmul(xq, W[K, N] (NZ), scale, pertoken_scale=x_scale, bias=bias, output_dtype).
    Unverified on NPU hardware: never run on an NPU by this project."""
    kw = dict(bias=bias, output_dtype=out_dtype)
    if x_scale is not None:
        kw["pertoken_scale"] = x_scale.reshape(-1)
    return _torch_npu().npu_quant_matmul(xq, w_kn, w_scale.reshape(-1), **kw)


def grouped_quant_matmul(xq: torch.Tensor, w_ekn: torch.Tensor, scales: torch.Tensor, per_token: torch.Tensor,
                         group_list: torch.Tensor, group_list_type: int = 0, out_dtype=torch.bfloat16) -> torch.Tensor:
    """npu_grouped_matmul([xq], [W[E, K, N] (NZ)], scale=[S[E, N]], per_token_scale=[t], group_list,
    split_item=2, group_type=0, group_list_type, output_dtype) -> one [M, N] tensor.
    Unverified on NPU hardware: never run on an NPU by this project."""
    out = _torch_npu().npu_grouped_matmul(
        [xq], [w_ekn], scale=[scales.reshape(scales.shape[0], -1)], per_token_scale=[per_token.reshape(-1)],
        group_list=group_list.to(torch.int64), split_item=2, group_type=0, group_list_type=group_list_type,
        output_dtype=out_dtype,
    )
    return out[0]


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """`ops.reference.rms_norm` through torch_npu.npu_rms_norm (one fused op; the reference rounds
    the normalised value to x's dtype before the weight multiply, so expect bf16-ulp differences).
    Unverified on NPU hardware: never run on an NPU by this project."""
    gamma = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device) if weight is None else weight.to(x.dtype)
    return _torch_npu().npu_rms_norm(x, gamma, epsilon=eps)[0]
