"""Triton kernel for `sparse_attention_with_sink` (see ops/reference.py for the meaning).

Why a kernel: the reference gathers every query's key rows into a [T, K, D] tensor before two
einsums; at DeepSeek-V4 sizes (K = SWA 128 + index_topk 512..1024 entries, D = 512) that copy is
the cost. Here each program owns one query token and a block of 16 heads, streams its key indices
in blocks, gathers rows straight from the pool and keeps an online softmax whose running max starts
at the sink logit (exp(sink - m) is the sink's share of the denominator), so nothing is
materialised and a query with no valid key returns 0 like the reference.

Written in the subset of Triton that triton-ascend also accepts (loads, stores, tl.dot,
reductions; no inline asm). Checked on CPU under TRITON_INTERPRET=1 against the reference.
Unverified on GPU and NPU hardware: this project has not run it on either yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 16  # tl.dot needs >= 16 rows; fewer heads are masked


@triton.jit
def _sparse_attn_sink_kernel(
    q_ptr, kv_ptr, idx_ptr, valid_ptr, sink_ptr, out_ptr,
    H, K, D, scale,
    stride_qt, stride_qh, stride_kvn, stride_it, stride_vt, stride_ot, stride_oh,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < H
    dmask = offs_d < D
    q = tl.load(q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
                mask=hmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    m = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)  # running max, seeded by the sink
    l = tl.full([BLOCK_H], 1.0, tl.float32)  # exp(sink - m) with m = sink
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        ok = tl.load(valid_ptr + t * stride_vt + offs_k, mask=kmask, other=0) != 0
        ok = ok & kmask
        idx = tl.load(idx_ptr + t * stride_it + offs_k, mask=ok, other=0)
        kv = tl.load(kv_ptr + idx[:, None] * stride_kvn + offs_d[None, :],
                     mask=ok[:, None] & dmask[None, :], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(kv), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_K]
        s = tl.where(ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
        m = m_new
    out = acc / l[:, None]
    tl.store(out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=hmask[:, None] & dmask[None, :])


def sparse_attention_with_sink(q, kv_pool, indices, valid, sink, scale: float, block_k: int = 32):
    """Same contract as ops.reference.sparse_attention_with_sink: q [T, H, D], kv_pool [N, D],
    indices/valid [T, K], sink [H] -> [T, H, D] in q's dtype."""
    T, H, D = q.shape
    K = indices.shape[1]
    out = torch.empty_like(q)
    if T == 0:
        return out
    q, kv_pool = q.contiguous(), kv_pool.contiguous()
    indices = indices.to(torch.int64).contiguous()
    valid = valid.to(torch.int8).contiguous()
    sink = sink.float().contiguous()
    grid = (T, triton.cdiv(H, BLOCK_H))
    _sparse_attn_sink_kernel[grid](
        q, kv_pool, indices, valid, sink, out,
        H, K, D, float(scale),
        q.stride(0), q.stride(1), kv_pool.stride(0), indices.stride(0), valid.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_H=BLOCK_H, BLOCK_K=block_k, BLOCK_D=triton.next_power_of_2(D),
    )
    return out
