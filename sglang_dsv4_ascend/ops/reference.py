"""Plain-torch definitions of the DeepSeek-V4 hot ops.

These are the semantics every faster implementation must reproduce. Precision rule (from the
official code): reductions that decide weights (norm statistics, softmaxes, Sinkhorn, router) run in
fp32; results are cast back to the activation dtype.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """y = x / sqrt(mean(x^2) + eps) * weight, statistics over the last dim in fp32.

    `weight=None` is the unweighted form V4 applies to every query head."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(x.dtype)
    return y if weight is None else weight * y


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, attention_factor: float = 1.0):
    """angle[p, i] = p * inv_freq[i] (one angle per rotated pair); returns fp32 (cos, sin)."""
    angles = positions.float()[..., None] * inv_freq.float()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Interleaved partial RoPE on the trailing 2*cos.shape[-1] channels of x.

    Pairs (x_{2i}, x_{2i+1}) of the rope slice rotate by angle a_i:
        y_{2i}   = x_{2i} cos a_i - x_{2i+1} sin a_i
        y_{2i+1} = x_{2i} sin a_i + x_{2i+1} cos a_i
    `inverse=True` rotates by -a_i (V4 applies it to the attention output, whose value vectors
    carried rotated rope channels). cos/sin: [T, rd/2]; x: [T, rd...] or [T, H, D] (heads broadcast).
    The leading (nope) channels pass through unchanged."""
    rd = 2 * cos.shape[-1]
    if x.dim() == cos.dim() + 1:  # [T, H, D]: broadcast over heads
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if inverse:
        sin = -sin
    nope, rope = x[..., :-rd], x[..., -rd:].float()
    x0, x1 = rope[..., 0::2], rope[..., 1::2]
    rotated = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def sinkhorn(logits: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Project [.., n, n] logits to an (approximately) doubly-stochastic matrix, in fp32.

    C = softmax_rows(logits) + eps; C /= colsum + eps; then (iters-1) times:
    C /= rowsum + eps; C /= colsum + eps."""
    c = torch.softmax(logits.float(), dim=-1) + eps
    c = c / (c.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        c = c / (c.sum(dim=-1, keepdim=True) + eps)
        c = c / (c.sum(dim=-2, keepdim=True) + eps)
    return c


def pad_rows(x: torch.Tensor, multiple: int = 16) -> torch.Tensor:
    """x with zero rows appended up to a multiple of `multiple` rows (none when it already is).

    The CPU's kernels are not row-invariant on small tensors: an fp32 matmul takes gemv /
    small-M kernels below 8 rows, whose reduction order differs from the blocked gemm's, and an
    elementwise transcendental (exp, sigmoid, softplus) runs its last numel % 32 elements through
    the scalar libm path instead of the vectorized one, which rounds differently (measured here,
    AVX512: softplus differs on 60 of 512 elements of [64, 8] computed one row at a time). So a
    verify forward's k rows and one-row decodes disagreed in the last bit, and in bf16 serving
    such a bit moved a near-tie (issue #29). Computed on rows padded to 16, every row's ops see
    the same kernel paths whatever the batch (tests/unit/test_logits_numerics.py). Other
    platforms' kernels are their own: unverified there."""
    pad = (multiple - x.shape[0] % multiple) % multiple
    if pad == 0:
        return x
    return torch.cat([x, x.new_zeros([pad] + list(x.shape[1:]))])


def row_invariant_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """F.linear(x [T, K], w [N, K]) whose every row gets the same bits whatever T is (pad_rows)."""
    return F.linear(pad_rows(x), w)[: x.shape[0]]


def mhc_mix(streams: torch.Tensor, fn: torch.Tensor, norm_eps: float) -> torch.Tensor:
    """mix = fn · (v / rms(v)) with v = flatten(streams) in fp32: streams [T, n, d] -> [T, rows(fn)]
    (row-invariant: it decides the stream weights of every token)."""
    v = streams.flatten(-2).float()
    return row_invariant_linear(rms_norm(v, None, norm_eps), fn.float())


def mhc_weights(streams, fn, base, scale, n: int, iters: int, hc_eps: float, norm_eps: float):
    """mHC coefficients for one sublayer, all fp32.

    pre_i  = sigmoid(mix_i * scale_0 + base_i) + hc_eps                (collapse n streams -> 1)
    post_i = 2 * sigmoid(mix_{n+i} * scale_1 + base_{n+i})             (expand output -> n streams)
    comb   = sinkhorn(reshape(mix_{2n:} * scale_2 + base_{2n:}, n x n)) (stream mixing, [src, dst])

    Computed on rows padded to 16 (pad_rows: the [T, n] sigmoids and the mix must not
    round differently for a one-row decode than for a verify's rows)."""
    rows = streams.shape[0]
    mix = mhc_mix(pad_rows(streams), fn, norm_eps)
    base, scale = base.float(), scale.float()
    pre = torch.sigmoid(mix[..., :n] * scale[0] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(mix[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = (mix[..., 2 * n :] * scale[2] + base[2 * n :]).unflatten(-1, (n, n))
    return pre[:rows], post[:rows], sinkhorn(comb_logits, iters, hc_eps)[:rows]


def softmax_pool(kv: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Compression of a window: out_c = sum_s softmax_s(gate_{s,c}) * kv_{s,c}, per channel c.

    kv, gate: [N, L, C] (window axis L); -inf gates exclude a slot. Computed in fp32."""
    w = torch.softmax(gate.float(), dim=1)
    return (kv.float() * w).sum(dim=1)


def pool_block_rows(
    kv: torch.Tensor, gate: torch.Tensor, ok: torch.Tensor, ape: torch.Tensor, overlap: bool
) -> torch.Tensor:
    """Compressor pooling of gathered block rows (layers/compressor.py): kv / gate [E, Lb, C] fp32
    in block order, ok [E, Lb] (False: the row does not exist, weight 0), ape [r, C] added to the
    gates by offset in the block. Without overlap Lb = r and C = D. With overlap (CSA) Lb = 2r and
    C = 2D: the previous block's rows pool through channels [0, D), the own block's through
    [D, 2D). -> [E, D] fp32, unnormalised."""
    r, D = ape.shape[0], (kv.shape[-1] // 2 if overlap else kv.shape[-1])
    ape = ape.float()
    kv = kv.masked_fill(~ok[..., None], 0.0)
    if not overlap:
        return softmax_pool(kv, gate + ape)
    gate_prev = (gate[:, :r, :D] + ape[:, :D]).masked_fill(~ok[:, :r, None], float("-inf"))
    kv = torch.cat([kv[:, :r, :D], kv[:, r:, D:]], dim=1)
    gate = torch.cat([gate_prev, gate[:, r:, D:] + ape[:, D:]], dim=1)
    return softmax_pool(kv, gate)


def block_pool(
    ring_kv, ring_gate, new_kv, new_gate, blk_ring, blk_fresh, blk_from_ring, blk_ok, ape, overlap: bool
) -> torch.Tensor:
    """`pool_block_rows` of rows gathered from two sources: row (e, l) is ring_kv/ring_gate
    [blk_ring[e, l]] (a committed compressor ring, flattened [S * Rc, C]) where blk_from_ring,
    else new_kv/new_gate[blk_fresh[e, l]] (this forward's rows [T, C]). -> [E, D] fp32."""
    from_ring = blk_from_ring[..., None]
    kv = torch.where(from_ring, ring_kv[blk_ring], new_kv[blk_fresh])
    gate = torch.where(from_ring, ring_gate[blk_ring], new_gate[blk_fresh])
    return pool_block_rows(kv, gate, blk_ok, ape, overlap)


def sparse_attention_with_sink(q, kv_pool, indices, valid, sink, scale: float, max_chunk_elems: int = 1 << 24):
    """Attention of each query over its own gathered key set, with a per-head sink.

    q [T, H, D]; kv_pool [N, D] holds the candidate rows, each both key and value (shared-KV MQA);
    query t uses rows kv_pool[indices[t, k]] where valid[t, k]; sink [H].
        l_{h,k} = scale * q_h . kv_k          (invalid: -inf)
        o_h = sum_k exp(l_{h,k} - m) kv_k / (exp(sink_h - m) + sum_k exp(l_{h,k} - m))
    with m = max(max_k l_{h,k}, sink_h): the sink only enlarges the denominator. The sink is finite,
    so a query with no valid key gets 0. Queries are gathered in chunks to bound memory."""
    T, H, D = q.shape
    K = indices.shape[1]
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    step = max(1, max_chunk_elems // max(1, K * max(D, H)))
    sink = sink.float().view(1, H, 1)
    for a in range(0, T, step):
        b = min(T, a + step)
        ok = valid[a:b]
        out[a:b] = _attend_with_sink(q[a:b], _gather_rows(kv_pool, indices[a:b], ok), ok, sink, scale)
    return out


def _gather_rows(pool, rows, ok, dtype=torch.float32):
    """pool[rows] in `dtype` (fp32 here; the torch_npu mapping gathers in q's dtype) with the
    invalid rows zeroed: a 0 probability times garbage (stale or NaN rows) must stay 0."""
    return pool[rows.clamp(0, max(0, pool.shape[0] - 1))].to(dtype).masked_fill(~ok[..., None], 0.0)


def _attend_with_sink(q, v, ok, sink, scale: float):
    """One chunk of queries q [t, H, D] over their gathered keys v [t, K, D] (valid where ok):
    softmax with the sink [1, H, 1] in the denominator. -> [t, H, D] in q's dtype.

    Accumulated in fp64. A batched forward pads every row's key list to the widest row of the
    batch (kvcache/plan.py), and in fp32 the softmax and the value sum round
    differently with a different count of masked slots: the same request gave different bits
    alone and beside a longer one (measured on the trained tiny model: a prefill beside a long
    neighbour differed in 1 of 6 cases), so a bf16 server's greedy output depended on what else
    it served and could not equal itself with and without speculation (issue #29). fp64 leaves
    a padding-dependent difference ~1e-16 relative, far below the rounding to q's dtype. The cost
    is this op's arithmetic in fp64 on the CPU reference path (`bench step`); the Triton and NPU
    kernels keep their own accumulation (unverified for batch invariance)."""
    v = v.double()
    logits = torch.einsum("thd,tkd->thk", q.double(), v) * scale
    logits = logits.masked_fill(~ok[:, None, :], float("-inf"))
    combined = torch.cat([logits, sink.double().expand(q.shape[0], -1, 1)], dim=-1)
    probs = torch.softmax(combined - combined.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, v).to(q.dtype)


class Source(NamedTuple):
    """Where a query's keys come from, for `sparse_attention_sources`: the keys of query t are
    pool[table[g, k] // div + offset] with g = group[t] (t when group is None), for the k with
    lo[t] <= k < hi[t] (and mask[t, k]). A group lets a whole request share one table row (its
    committed entries are listed once, not once per query row); `div` lets the table be a strided
    view of the token-slot map (entry j of a request at token_slots[slot, j r] // r)."""

    pool: torch.Tensor
    table: torch.Tensor
    group: Optional[torch.Tensor]
    lo: torch.Tensor
    hi: torch.Tensor
    mask: Optional[torch.Tensor] = None
    div: int = 1
    offset: int = 0


def source_rows(src: Source, a: int, b: int):
    """(pool rows [b-a, K], valid [b-a, K]) of queries a..b-1 of one source."""
    table = src.table[a:b] if src.group is None else src.table[src.group[a:b]]
    rows = table.long() // src.div + src.offset if (src.div != 1 or src.offset) else table.long()
    k = torch.arange(table.shape[-1], device=table.device)
    ok = (k >= src.lo[a:b, None]) & (k < src.hi[a:b, None])
    if src.mask is not None:
        ok = ok & src.mask[a:b]
    return rows, ok


def gather_sources(sources, a: int, b: int, dtype=torch.float32):
    """(keys [b-a, K, D] in `dtype`, valid [b-a, K]) of queries a..b-1: every Source's rows in
    source order, invalid rows zeroed. `sources` holds no empty table (K > 0)."""
    vs, oks = [], []
    for src in sources:
        rows, ok = source_rows(src, a, b)
        vs.append(_gather_rows(src.pool, rows, ok, dtype))
        oks.append(ok)
    return torch.cat(vs, dim=1), torch.cat(oks, dim=1)


def sparse_attention_sources(q, sources, sink, scale: float, max_chunk_elems: int = 1 << 24):
    """`sparse_attention_with_sink` over keys drawn from several pools (`Source`s) without
    copying them: the keys of all sources form one softmax with the sink, in source order, so the
    result equals the single-pool op on the concatenated key sets. Queries are processed in
    chunks to bound memory."""
    T, H, D = q.shape
    out = torch.empty(T, H, D, dtype=q.dtype, device=q.device)
    sources = [s for s in sources if s.table.shape[-1] > 0]
    K = sum(s.table.shape[-1] for s in sources)
    step = max(1, max_chunk_elems // max(1, K * max(D, H)))
    sink = sink.float().view(1, H, 1)
    for a in range(0, T, step):
        b = min(T, a + step)
        if not sources:
            out[a:b] = 0
            continue
        out[a:b] = _attend_with_sink(q[a:b], *gather_sources(sources, a, b), sink, scale)
    return out


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """h = silu(min(gate, limit)) * clamp(up, -limit, limit); limit <= 0 disables the clamp."""
    if limit > 0:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def sqrtsoftplus(logits: torch.Tensor) -> torch.Tensor:
    """Router score s = sqrt(softplus(logit))."""
    return F.softplus(logits).sqrt()
