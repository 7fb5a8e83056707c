"""Triton W8A8 kernels: per-token dynamic int8 quantization, int8 GEMM with the dequant epilogue.

Both reproduce the bit rules of `sglang_dsv4_ascend/ops/quant.py` (the definition):

* `dynamic_quant`: one program per row; pass 1 takes amax of fp32(x) [* smooth], scale =
  amax * fp32(1/127); pass 2 divides with IEEE round-to-nearest (`tl.math.div_rn`: Triton's plain
  `/` on fp32 may lower to an approximate division on GPUs) and rounds half to even with floor
  arithmetic (exact for |v| < 2^23, and the quotient is <= ~127 here), then saturates to int8.
  All-zero rows: scale 0, q 0.
* `quant_matmul`: int32 accumulation with `tl.dot(int8, int8) -> int32` (exact: |acc| <= K * 2^14
  < 2^31 for K < 131072), then [+ int32 bias] -> fp32(acc) * fp32(scale[n]) [* x_scale[m]]
  [+ float bias] -> output dtype (round to nearest even; for bf16 written out in integer
  arithmetic, because the Triton interpreter's fp32 -> bf16 cast truncates).

Checked on CPU under TRITON_INTERPRET=1 against the reference (tests/unit/test_w8a8_ops.py).
On a GPU or an Ascend NPU (triton-ascend) these kernels have NOT been run by this project:
`div_rn`, `tl.floor` and int8 `tl.dot` support in triton-ascend is unverified.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .. import quant as ref

_INV_127 = float(ref.INV_127.item())  # fp32(1/127) as a Python float (exact: the fp32 value)


@triton.jit
def _round_half_even(v):
    r = tl.floor(v)
    d = v - r  # exact for |v| < 2^23
    half = r * 0.5
    odd = half != tl.floor(half)
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _load_block(x_row, smooth_ptr, offs, m, HAS_SMOOTH: tl.constexpr):
    """x[offs] in fp32, times the smooth scales when given (both passes read the row this way)."""
    x = tl.load(x_row + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_SMOOTH:
        x = x * tl.load(smooth_ptr + offs, mask=m, other=0.0).to(tl.float32)
    return x


@triton.jit
def _dynamic_quant_kernel(
    x_ptr, smooth_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm, inv127, HAS_SMOOTH: tl.constexpr, BLOCK_K: tl.constexpr
):
    row = tl.program_id(0)
    x_row = x_ptr + row * stride_xm
    q_row = q_ptr + row * stride_qm
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        m = offs < K
        x = _load_block(x_row, smooth_ptr, offs, m, HAS_SMOOTH)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.max(amax, axis=0) * inv127
    tl.store(s_ptr + row, scale)
    is_zero = scale == 0.0
    safe = tl.where(is_zero, 1.0, scale)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + tl.arange(0, BLOCK_K)
        m = offs < K
        x = _load_block(x_row, smooth_ptr, offs, m, HAS_SMOOTH)
        v = tl.math.div_rn(x, tl.zeros([BLOCK_K], dtype=tl.float32) + safe)
        r = _round_half_even(v)
        r = tl.minimum(tl.maximum(r, -128.0), 127.0)
        r = tl.where(is_zero, 0.0, r)
        tl.store(q_row + offs, r.to(tl.int8), mask=m)


def dynamic_quant(x: torch.Tensor, smooth: Optional[torch.Tensor] = None, block_k: int = 1024):
    """Same contract as `ops.quant.dynamic_quant`: x [..., K] -> (int8 [..., K], fp32 scale [...])."""
    K = x.shape[-1]
    x2 = x.reshape(-1, K).contiguous()
    M = x2.shape[0]
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M:
        sm = smooth.reshape(-1).contiguous() if smooth is not None else x2  # dummy pointer when absent
        bk = min(triton.next_power_of_2(max(K, 1)), block_k)
        _dynamic_quant_kernel[(M,)](
            x2, sm, q, s, K, x2.stride(0), q.stride(0), _INV_127, HAS_SMOOTH=smooth is not None, BLOCK_K=bk
        )
    return q.reshape(x.shape), s.reshape(x.shape[:-1])


@triton.jit
def _fp32_to_bf16_bits(y):
    """fp32 -> bf16 bit pattern (int16), round to nearest even, written out in integer arithmetic
    (finite values; NaN payloads not preserved). Explicit because the Triton interpreter's
    fp32 -> bf16 cast truncates, unlike compiled Triton (RTNE)."""
    bits = y.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return rounded.to(tl.int16)


@triton.jit
def _int8_gemm_dequant_kernel(
    a_ptr,
    b_ptr,
    scale_ptr,
    tok_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_om,
    stride_on,
    HAS_TOK: tl.constexpr,
    BIAS_KIND: tl.constexpr,
    OUT_BF16: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(0, K, BLOCK_K):
        ka = k0 + rk
        a = tl.load(
            a_ptr + rm[:, None] * stride_am + ka[None, :] * stride_ak,
            mask=(rm[:, None] < M) & (ka[None, :] < K),
            other=0,
        )
        b = tl.load(
            b_ptr + ka[:, None] * stride_bk + rn[None, :] * stride_bn,
            mask=(ka[:, None] < K) & (rn[None, :] < N),
            other=0,
        )
        acc += tl.dot(a, b, out_dtype=tl.int32)
    nmask = rn < N
    if BIAS_KIND == 1:
        acc += tl.load(bias_ptr + rn, mask=nmask, other=0)[None, :]
    y = acc.to(tl.float32) * tl.load(scale_ptr + rn, mask=nmask, other=0.0)[None, :]
    if HAS_TOK:
        y = y * tl.load(tok_ptr + rm, mask=rm < M, other=0.0)[:, None]
    if BIAS_KIND == 2:
        y = y + tl.load(bias_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    if OUT_BF16:
        out = _fp32_to_bf16_bits(y)  # out_ptr is the int16 view of the bf16 output
    else:
        out = y.to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :] * stride_on, out, mask=(rm[:, None] < M) & nmask[None, :])


def _effective_scale(scale: torch.Tensor, out_dtype, x_scale, bias) -> torch.Tensor:
    """The fp32 scale the epilogue multiplies by (int64 deq format / fp16 truncation as in the reference)."""
    scale = scale.reshape(-1)
    if scale.dtype == torch.int64:
        return ref.deq_scale_int64_to_fp32(scale).contiguous()
    s32 = scale.float()
    if out_dtype == torch.float16 and x_scale is None and (bias is None or not bias.is_floating_point()):
        s32 = ref._truncate_fp16_deq(s32)
    return s32.contiguous()


def quant_matmul(
    xq: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    out_dtype=torch.bfloat16,
    *,
    w_layout: str = "nk",
    block_m: int = 32,
    block_n: int = 64,
    block_k: int = 64,
) -> torch.Tensor:
    """Same contract as `ops.quant.quant_matmul` (xq int8 [M, K], wq int8 [N, K] or [K, N])."""
    if xq.dtype != torch.int8 or wq.dtype != torch.int8:
        raise TypeError(f"quant_matmul takes int8 operands, got {xq.dtype} and {wq.dtype}")
    b = wq.t() if w_layout == "nk" else wq  # [K, N] view
    M, K = xq.shape
    N = b.shape[1]
    if b.shape[0] != K:
        raise ValueError(f"quant_matmul: x has K={K} but the weight ({w_layout}) has shape {tuple(wq.shape)}")
    out = torch.empty((M, N), dtype=out_dtype, device=xq.device)
    scale = _effective_scale(w_scale, out_dtype, x_scale, bias)
    tok = x_scale.reshape(-1).float().contiguous() if x_scale is not None else scale
    kind = 0 if bias is None else (2 if bias.is_floating_point() else 1)
    bias_t = bias.reshape(-1).contiguous() if bias is not None else scale
    if kind == 1:
        bias_t = bias_t.to(torch.int32)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    bf16 = out_dtype == torch.bfloat16
    dst = out.view(torch.int16) if bf16 else out
    if M and N:
        _int8_gemm_dequant_kernel[grid](
            xq,
            b,
            scale,
            tok,
            bias_t,
            dst,
            M,
            N,
            K,
            xq.stride(0),
            xq.stride(1),
            b.stride(0),
            b.stride(1),
            out.stride(0),
            out.stride(1),
            HAS_TOK=x_scale is not None,
            BIAS_KIND=kind,
            OUT_BF16=bf16,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
        )
    return out
