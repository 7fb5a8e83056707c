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

from ..reference import source_rows

BLOCK_H = 16  # tl.dot needs >= 16 rows; fewer heads are masked


@triton.jit
def _online_softmax_step(q, kv, ok, m, l, acc, scale):
    """Fold one block of keys kv [BLOCK_K, BLOCK_D] (valid where ok) into the running max m,
    denominator l and numerator acc of every head."""
    s = tl.dot(q, tl.trans(kv), input_precision="ieee") * scale  # [BLOCK_H, BLOCK_K]
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
    return m_new, l, acc


@triton.jit
def _sparse_attn_sink_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    valid_ptr,
    sink_ptr,
    out_ptr,
    H,
    K,
    D,
    scale,
    stride_qt,
    stride_qh,
    stride_kvn,
    stride_it,
    stride_vt,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < H
    dmask = offs_d < D
    q = tl.load(
        q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    m = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)  # running max, seeded by the sink
    l = tl.full([BLOCK_H], 1.0, tl.float32)  # exp(sink - m) with m = sink
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        ok = tl.load(valid_ptr + t * stride_vt + offs_k, mask=kmask, other=0) != 0
        ok = ok & kmask
        idx = tl.load(idx_ptr + t * stride_it + offs_k, mask=ok, other=0)
        kv = tl.load(
            kv_ptr + idx[:, None] * stride_kvn + offs_d[None, :], mask=ok[:, None] & dmask[None, :], other=0.0
        ).to(tl.float32)
        m, l, acc = _online_softmax_step(q, kv, ok, m, l, acc, scale)
    out = acc / l[:, None]
    tl.store(
        out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None] & dmask[None, :],
    )


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
        q,
        kv_pool,
        indices,
        valid,
        sink,
        out,
        H,
        K,
        D,
        float(scale),
        q.stride(0),
        q.stride(1),
        kv_pool.stride(0),
        indices.stride(0),
        valid.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_H=BLOCK_H,
        BLOCK_K=block_k,
        BLOCK_D=triton.next_power_of_2(D),
    )
    return out


@triton.jit
def _sparse_attn_two_pools_kernel(
    q_ptr,
    kva_ptr,
    kvb_ptr,
    idx_ptr,
    sink_ptr,
    out_ptr,
    H,
    K,
    D,
    scale,
    stride_qt,
    stride_qh,
    stride_kan,
    stride_kbn,
    stride_it,
    stride_ot,
    stride_oh,
    BLOCK_H: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """As _sparse_attn_sink_kernel, with keys from two pools in one index list: idx >= 0 is row idx
    of pool A (the layer's committed store), idx <= -2 is row -idx - 2 of pool B (this forward's
    fresh rows), -1 is no key."""
    t = tl.program_id(0)
    hb = tl.program_id(1)
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    hmask = offs_h < H
    dmask = offs_d < D
    q = tl.load(
        q_ptr + t * stride_qt + offs_h[:, None] * stride_qh + offs_d[None, :],
        mask=hmask[:, None] & dmask[None, :],
        other=0.0,
    ).to(tl.float32)
    m = tl.load(sink_ptr + offs_h, mask=hmask, other=0.0).to(tl.float32)
    l = tl.full([BLOCK_H], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        kmask = offs_k < K
        idx = tl.load(idx_ptr + t * stride_it + offs_k, mask=kmask, other=-1)
        in_a = kmask & (idx >= 0)
        in_b = kmask & (idx <= -2)
        ok = in_a | in_b
        row_a = tl.where(in_a, idx, 0)
        row_b = tl.where(in_b, -idx - 2, 0)
        kv = tl.load(
            kva_ptr + row_a[:, None] * stride_kan + offs_d[None, :], mask=in_a[:, None] & dmask[None, :], other=0.0
        ).to(tl.float32)
        kv += tl.load(
            kvb_ptr + row_b[:, None] * stride_kbn + offs_d[None, :], mask=in_b[:, None] & dmask[None, :], other=0.0
        ).to(tl.float32)
        m, l, acc = _online_softmax_step(q, kv, ok, m, l, acc, scale)
    out = acc / l[:, None]
    tl.store(
        out_ptr + t * stride_ot + offs_h[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=hmask[:, None] & dmask[None, :],
    )


def merged_indices(sources, T: int):
    """(pool A, pool B, idx [T, K] int64) for `sources` drawing from at most two pools: each
    Source's table resolved to pool rows (integer work only, no key is copied) and encoded as
    the two-pool kernel reads them (A: row, B: -row - 2, no key: -1), in source order."""
    pools, parts = [], []
    for src in sources:
        if src.table.shape[-1] == 0:
            continue
        which = next((i for i, p in enumerate(pools) if p is src.pool), None)
        if which is None:
            if len(pools) == 2:
                raise ValueError("sparse_attention_sources (Triton): keys from more than two pools")
            pools.append(src.pool)
            which = len(pools) - 1
        rows, ok = source_rows(src, 0, T)
        rows = rows.clamp(0, src.pool.shape[0] - 1)
        parts.append(torch.where(ok, rows if which == 0 else -rows - 2, -1))
    if not parts:
        return None, None, None
    pool_a = pools[0]
    pool_b = pools[1] if len(pools) > 1 else pools[0][:1]
    return pool_a, pool_b, torch.cat(parts, 1)


def sparse_attention_sources(q, sources, sink, scale: float, block_k: int = 32):
    """Same contract as ops.reference.sparse_attention_sources (keys from several Sources, one
    softmax with the sink, in source order), for sources over at most two pools (the batched
    attention's committed store and fresh rows): one kernel launch per layer."""
    T, H, D = q.shape
    out = torch.empty_like(q)
    if T == 0:
        return out
    pool_a, pool_b, idx = merged_indices(sources, T)
    if idx is None:
        return out.zero_()
    q, pool_a, pool_b, idx = q.contiguous(), pool_a.contiguous(), pool_b.contiguous(), idx.contiguous()
    grid = (T, triton.cdiv(H, BLOCK_H))
    _sparse_attn_two_pools_kernel[grid](
        q,
        pool_a,
        pool_b,
        idx,
        sink.float().contiguous(),
        out,
        H,
        idx.shape[1],
        D,
        float(scale),
        q.stride(0),
        q.stride(1),
        pool_a.stride(0),
        pool_b.stride(0),
        idx.stride(0),
        out.stride(0),
        out.stride(1),
        BLOCK_H=BLOCK_H,
        BLOCK_K=block_k,
        BLOCK_D=triton.next_power_of_2(D),
    )
    return out
