"""Triton kernel for `block_pool` (see ops/reference.py for the meaning): the compressor pooling of
every entry a batched forward completes.

Why a kernel: the reference gathers each entry's block rows from two sources (the committed ring
and this forward's rows) into [E, Lb, C] kv and gate tensors, selects between them, slices the
overlap halves, adds the ape and runs a softmax pool: five materialised copies of the window for
every CSA / HCA layer. Here one program owns one entry and a block of channels and streams its Lb
rows straight from whichever source holds them, with an online per-channel softmax, so nothing is
materialised.

Written in the subset of Triton that triton-ascend also accepts (scalar and vector loads,
elementwise math; no tl.dot, no inline asm). Checked on CPU under TRITON_INTERPRET=1 against the
reference. Unverified on GPU and NPU hardware: this project has not run it on either yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_D = 64


@triton.jit
def _block_pool_kernel(
    ring_kv,
    ring_gate,
    new_kv,
    new_gate,
    blk_ring,
    blk_fresh,
    blk_from_ring,
    blk_ok,
    ape,
    out,
    D,
    C,
    stride_blk,
    R: tl.constexpr,
    LB: tl.constexpr,
    OVERLAP: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    e = tl.program_id(0)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    m = tl.full([BLOCK_D], -1e30, tl.float32)  # finite: a missing first row must not give inf - inf
    s = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for l in range(LB):
        if OVERLAP:  # the previous block pools channels [0, D), the own block [D, 2D)
            col = d + (l // R) * D  # l // R: 0 for the previous block, 1 for the own
        else:
            col = d
        base = e * stride_blk + l
        from_ring = tl.load(blk_from_ring + base) != 0
        ok = tl.load(blk_ok + base) != 0
        ring_row = tl.load(blk_ring + base).to(tl.int64)
        new_row = tl.load(blk_fresh + base).to(tl.int64)
        use_ring = dmask & from_ring & ok
        use_new = dmask & (from_ring == 0) & ok
        kv = tl.load(ring_kv + ring_row * C + col, mask=use_ring, other=0.0) + tl.load(
            new_kv + new_row * C + col, mask=use_new, other=0.0
        )
        g = tl.load(ring_gate + ring_row * C + col, mask=use_ring, other=0.0) + tl.load(
            new_gate + new_row * C + col, mask=use_new, other=0.0
        )
        g = g + tl.load(ape + (l % R) * C + col, mask=dmask, other=0.0)
        m_new = tl.where(ok, tl.maximum(m, g), m)
        alpha = tl.exp(m - m_new)
        p = tl.where(ok, tl.exp(g - m_new), 0.0)
        s = s * alpha + p
        acc = acc * alpha + p * kv
        m = m_new
    tl.store(out + e * D + d, acc / s, mask=dmask)


def block_pool(
    ring_kv, ring_gate, new_kv, new_gate, blk_ring, blk_fresh, blk_from_ring, blk_ok, ape, overlap: bool
) -> torch.Tensor:
    E, LB = blk_ring.shape
    r, C = ape.shape
    D = C // 2 if overlap else C
    out = torch.empty(E, D, dtype=torch.float32, device=ring_kv.device)
    if E == 0:
        return out
    f32 = [t.float().contiguous() for t in (ring_kv, ring_gate, new_kv, new_gate, ape)]
    idx = [t.contiguous() for t in (blk_ring, blk_fresh, blk_from_ring.to(torch.int8), blk_ok.to(torch.int8))]
    grid = (E, triton.cdiv(D, BLOCK_D))
    _block_pool_kernel[grid](
        f32[0], f32[1], f32[2], f32[3], *idx, f32[4], out, D, C, LB, R=r, LB=LB, OVERLAP=overlap, BLOCK_D=BLOCK_D
    )
    return out
