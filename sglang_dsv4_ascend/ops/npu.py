"""torch_npu calls for the hot ops: the 'npu' kernel family of `ops/__init__.py` and `ops/quant.py`.

UNVERIFIED ON NPU HARDWARE: nothing in this file has ever been run on an Ascend NPU by this
project. The W8A8 calls follow the op-plugin documentation and SGLang 0.5.23's NPU linear / MoE
methods (docs/dsv4_reference.md §4.3, §4.4); tests/device/test_npu_w8a8.py and test_npu_ops.py
compare each one with the plain-torch reference and are skipped where torch_npu is not installed.

The batched attention (`sparse_attention_with_sink`, `sparse_attention_sources`) is mapped to
`torch_npu.npu_fused_infer_attention_score` over keys gathered per query row (the reference's own
gather), plus an exact fp32 correction for the attention sink, which that op does not take. The
gather materialises each chunk's [rows, K, D] keys (bounded by max_chunk_elems). On CPU,
tests/unit/test_npu_attention_mapping.py checks the mapping against the reference through a fake
torch_npu written from the op's documentation; the real op's behaviour is unverified.
SGLang's NPU DeepSeek-V4 backend instead runs `torch.ops.custom.npu_sparse_attn_sharedkv`, which
reads its paged SWA / compressed-KV pools through block tables and so needs no gather; our cache
keeps per-request SWA rings and an entry store addressed through token slots, so using it needs
that layout (or a gather into it) first.

Tree verify (speculative/engine.py) needs nothing more of the batched attention than the chain
does: a node-once tree row's key list is "its request's committed rows + its ancestors' rows +
the entries its ancestors completed", given as the per-row index lists and masks the plan builds
(kvcache/plan.py), which is what the mapping below gathers. A `npu_sparse_attn_sharedkv` mapping
would pass the same lists. Unwritten.

`torch_npu` is imported inside each function, never at module import: importing it without CANN
breaks `import torch`, and this module is imported on CPU machines too.

Weight layout: `prepare_weight` turns the checkpoint's int8 [.., N, K] into [.., K, N] contiguous and
casts it to FRACTAL_NZ (ACL format 29), as SGLang's `process_weights_after_loading` does; the matmuls
below take that layout.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import reference

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


def static_quant(
    x: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor, param_dtype=torch.bfloat16
) -> torch.Tensor:
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


def quant_matmul(
    xq: torch.Tensor,
    w_kn: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    out_dtype=torch.bfloat16,
) -> torch.Tensor:
    """npu_quant_matmul(xq, W[K, N] (NZ), scale, pertoken_scale=x_scale, bias=bias, output_dtype).
    Unverified on NPU hardware: never run on an NPU by this project."""
    kw = dict(bias=bias, output_dtype=out_dtype)
    if x_scale is not None:
        kw["pertoken_scale"] = x_scale.reshape(-1)
    return _torch_npu().npu_quant_matmul(xq, w_kn, w_scale.reshape(-1), **kw)


def grouped_quant_matmul(
    xq: torch.Tensor,
    w_ekn: torch.Tensor,
    scales: torch.Tensor,
    per_token: torch.Tensor,
    group_list: torch.Tensor,
    group_list_type: int = 0,
    out_dtype=torch.bfloat16,
) -> torch.Tensor:
    """npu_grouped_matmul([xq], [W[E, K, N] (NZ)], scale=[S[E, N]], per_token_scale=[t], group_list,
    split_item=2, group_type=0, group_list_type, output_dtype) -> one [M, N] tensor.
    Unverified on NPU hardware: never run on an NPU by this project."""
    out = _torch_npu().npu_grouped_matmul(
        [xq],
        [w_ekn],
        scale=[scales.reshape(scales.shape[0], -1)],
        per_token_scale=[per_token.reshape(-1)],
        group_list=group_list.to(torch.int64),
        split_item=2,
        group_type=0,
        group_list_type=group_list_type,
        output_dtype=out_dtype,
    )
    return out[0]


def rms_norm(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """`ops.reference.rms_norm` through torch_npu.npu_rms_norm (one fused op; the reference rounds
    the normalised value to x's dtype before the weight multiply, so expect bf16-ulp differences).
    Unverified on NPU hardware: never run on an NPU by this project."""
    gamma = torch.ones(x.shape[-1], dtype=x.dtype, device=x.device) if weight is None else weight.to(x.dtype)
    return _torch_npu().npu_rms_norm(x, gamma, epsilon=eps)[0]


# ------------------------------------------------------------------------------------------------
# Batched sparse attention with a sink: npu_fused_infer_attention_score + sink correction.
#
# What is relied on (Ascend/op-plugin docs/context/torch_npu-npu_fused_infer_attention_score.md and
# torch_npu's own tests of the op; none of it observed on hardware here):
# * signature: (query, key, value, *, atten_mask, num_heads, scale, input_layout,
#   num_key_value_heads, softmax_lse_flag, ...) -> (attention_out, softmax_lse), as vllm-ascend
#   calls it (older torch_npu docs, PyTorch extension 6.0.RC3, name the keyword `scale_value`);
# * attention_out = softmax(scale * query . key^T, masked) . value, in the layout of query;
# * atten_mask: bool / int8 / uint8, True = masked (that position takes no part in the softmax);
#   for Q_S = 1 the documented shapes are (B, KV_S), (B, 1, KV_S), (B, 1, 1, KV_S);
# * softmax_lse: fp32, natural-log logsumexp of the scaled, masked scores, shape (B, N, Q_S, 1)
#   ("in general"). With Q_S = 1 a (B, Q_S, N, 1) layout holds the same elements in the same order,
#   so `reshape(B, N)` reads it either way;
# * query fp16 / bf16 only; B <= 65536, N <= 256, D <= 512 when Q_S = 1;
#   num_heads / num_key_value_heads <= 64;
# * a row whose keys are all masked is not specified (row-invalid correction, inner_precise 2/3,
#   is documented as unavailable for Q_S = 1), so such rows are set to 0 here, as the reference.
# Newer torch_npu has `npu_fused_infer_attention_score_v2(..., learnable_sink=...)` (TND layout,
# newer CANN per its tests), which would take the sink itself; not used.

FIA_DTYPES = (torch.float16, torch.bfloat16)  # query dtypes the op documents
MAX_HEADS_PER_CALL = 64  # num_heads / num_key_value_heads <= 64, and one shared KV head here
MAX_ROWS_PER_CALL = 65536  # B <= 65536


def _key_mask(ok: torch.Tensor) -> torch.Tensor:
    """valid [t, K] -> atten_mask [t, 1, 1, K] bool, True where the key is masked (invalid)."""
    return (~ok).reshape(ok.shape[0], 1, 1, ok.shape[1]).contiguous()


def _with_sink(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """The sink correction, fp32. The op gives out = sum_k e^{l_k} v_k / S with S = sum_k e^{l_k}
    and lse = log S; the reference's softmax over keys and sink has the denominator S + e^{s}, so
    its output is out * S / (S + e^{s}) = out * sigmoid(lse - s). out [t, h, D], lse [t, h], sink [h]."""
    return out.float() * torch.sigmoid(lse.float() - sink)[..., None]


def _attend_fia(q, kv, ok, sink, scale: float):
    """One chunk: q [t, H, D] over its gathered keys kv [t, K, D] (q's dtype, invalid rows zero),
    valid where ok [t, K], sink [H] fp32 -> [t, H, D] in q's dtype. Keys and values are the same
    rows (shared-KV MQA): one KV head in BSND, key = value. Heads go in groups of at most
    MAX_HEADS_PER_CALL."""
    t, H, D = q.shape
    K = kv.shape[1]
    fia = _torch_npu().npu_fused_infer_attention_score
    key = kv.reshape(t, K, 1, D).contiguous()
    mask = _key_mask(ok)
    out = torch.empty(t, H, D, dtype=q.dtype, device=q.device)
    for h0 in range(0, H, MAX_HEADS_PER_CALL):
        h = min(H, h0 + MAX_HEADS_PER_CALL) - h0
        o, lse = fia(
            q[:, h0 : h0 + h].reshape(t, 1, h, D).contiguous(),
            key,
            key,
            atten_mask=mask,
            num_heads=h,
            scale=float(scale),
            input_layout="BSND",
            num_key_value_heads=1,
            softmax_lse_flag=True,
        )
        out[:, h0 : h0 + h] = _with_sink(o.reshape(t, h, D), lse.reshape(t, h), sink[h0 : h0 + h]).to(q.dtype)
    return out.masked_fill_(~ok.any(dim=1)[:, None, None], 0)


def _attend_chunks(q, sink, scale: float, K: int, max_chunk_elems: int, gather):
    """The shared loop: per chunk a..b of query rows (the reference's chunk, which bounds the
    gathered [rows, K, D], at most MAX_ROWS_PER_CALL), `gather(a, b) -> (kv [b-a, K, D] in q's
    dtype, valid [b-a, K])`, then `_attend_fia`. Zero rows or keys give zeros without a call."""
    T, H, D = q.shape
    out = torch.zeros(T, H, D, dtype=q.dtype, device=q.device)
    if T == 0 or K == 0:
        return out
    sink = sink.float().reshape(H)
    step = min(MAX_ROWS_PER_CALL, max(1, max_chunk_elems // max(1, K * max(D, H))))
    for a in range(0, T, step):
        b = min(T, a + step)
        kv, ok = gather(a, b)
        out[a:b] = _attend_fia(q[a:b], kv, ok, sink, scale)
    return out


def sparse_attention_with_sink(q, kv_pool, indices, valid, sink, scale: float, max_chunk_elems: int = 1 << 24):
    """`ops.reference.sparse_attention_with_sink` through npu_fused_infer_attention_score: per chunk
    of query rows, the rows' keys gathered into [t, K, 1, D] (one shared KV head), invalid keys
    masked, then the sink correction `_with_sink` in fp32; a row with no valid key gives 0. A q
    of a dtype the op does not take (fp32) runs the reference.
    Unverified on NPU hardware: never run on an NPU by this project."""
    if q.dtype not in FIA_DTYPES:
        return reference.sparse_attention_with_sink(q, kv_pool, indices, valid, sink, scale, max_chunk_elems)

    def gather(a, b):
        return reference._gather_rows(kv_pool, indices[a:b], valid[a:b], q.dtype), valid[a:b]

    return _attend_chunks(q, sink, scale, indices.shape[1], max_chunk_elems, gather)


def sparse_attention_sources(q, sources, sink, scale: float, max_chunk_elems: int = 1 << 24):
    """`ops.reference.sparse_attention_sources` through npu_fused_infer_attention_score: per chunk
    of query rows, the keys of all Sources gathered by the reference's `gather_sources` (source
    order, invalid rows zero) into one [t, K, 1, D] key set, one softmax with the sink as in
    `sparse_attention_with_sink`. A q of a dtype the op does not take (fp32) runs the reference.
    Unverified on NPU hardware: never run on an NPU by this project."""
    if q.dtype not in FIA_DTYPES:
        return reference.sparse_attention_sources(q, sources, sink, scale, max_chunk_elems)
    sources = [s for s in sources if s.table.shape[-1] > 0]
    return _attend_chunks(
        q,
        sink,
        scale,
        sum(s.table.shape[-1] for s in sources),
        max_chunk_elems,
        lambda a, b: reference.gather_sources(sources, a, b, q.dtype),
    )
