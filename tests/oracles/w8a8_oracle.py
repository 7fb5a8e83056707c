"""Independent oracles for the Ascend W8A8 bit rules (docs/dsv4_reference.md §4.4 / §4.5).

Written to be obviously correct rather than fast, and never importing sglang_dsv4_ascend:
* integer products in numpy int64 (exact: numpy's integer matmul does not go through BLAS);
* fp32 arithmetic with numpy float32 scalars/arrays (IEEE binary32, one rounding per operation);
* round-half-to-even spelled out with floor and an explicit tie test, never np.round/torch.round;
* bf16 rounding spelled out on the fp32 bit pattern (add 0x7FFF + lsb, drop 16 bits);
* the static-quant reciprocal from exact rationals (fractions.Fraction).
Inputs are numpy arrays (the tests convert torch tensors with .float().numpy(): exact).
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

F32 = np.float32
INV127 = F32(1.0) / F32(127.0)  # fp32(1/127): correctly rounded quotient


def rne_array(v: np.ndarray) -> np.ndarray:
    """Round half to even, elementwise, on float values (float64 holds any fp32 exactly)."""
    v = np.asarray(v, dtype=np.float64)
    f = np.floor(v)
    d = v - f  # exact: f and v share the binade (or f is a smaller integer)
    f_is_odd = np.mod(f, 2.0) == 1.0
    up = (d > 0.5) | ((d == 0.5) & f_is_odd)
    return f + up


def rne_int(v: Fraction) -> int:
    """Round half to even of an exact rational."""
    f = math.floor(v)
    d = v - f
    if d > Fraction(1, 2) or (d == Fraction(1, 2) and f % 2 == 1):
        return f + 1
    return f


def saturate_int8(r: np.ndarray) -> np.ndarray:
    return np.minimum(np.maximum(r, -128), 127).astype(np.int64)


def dynamic_quant(x: np.ndarray, smooth: np.ndarray | None = None):
    """x [M, K] (values representable in fp32) -> (q int64 [M, K], scale float32 [M])."""
    x32 = np.asarray(x, dtype=F32)
    if smooth is not None:
        x32 = x32 * np.asarray(smooth, dtype=F32)[None, :]  # fp32 multiply
    M, K = x32.shape
    q = np.zeros((M, K), dtype=np.int64)
    scale = np.zeros(M, dtype=F32)
    for m in range(M):
        amax = F32(np.max(np.abs(x32[m]))) if K else F32(0)
        s = F32(amax * INV127)  # one fp32 multiply
        scale[m] = s
        if s == 0:
            continue  # all-zero row: q = 0 (the reference's guard)
        quotient = x32[m] / s  # fp32 IEEE division, elementwise
        q[m] = saturate_int8(rne_array(quotient))
    return q, scale


def bf16_round_bits(y: np.ndarray) -> np.ndarray:
    """fp32 -> bf16 bit pattern (uint16), round to nearest even (finite inputs)."""
    bits = np.asarray(y, dtype=F32).view(np.uint32).astype(np.uint64)
    lsb = (bits >> 16) & 1
    return (((bits + 0x7FFF + lsb) >> 16) & 0xFFFF).astype(np.uint16)


def bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (np.asarray(bits, dtype=np.uint32) << 16).astype(np.uint32).view(F32)


def round_to_bf16(v: Fraction) -> Fraction:
    """Exact rational -> nearest bf16 value (8 significant bits, ties to even), normal range."""
    if v == 0:
        return Fraction(0)
    sign = -1 if v < 0 else 1
    a = abs(v)
    e = math.floor(math.log2(a.numerator) - math.log2(a.denominator))
    while Fraction(2) ** e > a:  # fix log2 rounding
        e -= 1
    while Fraction(2) ** (e + 1) <= a:
        e += 1
    ulp = Fraction(2) ** (e - 7)
    return sign * rne_int(a / ulp) * ulp


def static_quant(x: np.ndarray, input_scale: float, input_offset: float) -> np.ndarray:
    """SGLang/npu_quantize static int8: recip = bf16(1 / bf16(scale)) (exact rationals, one rounding
    each), q = sat(rne(fp32(fp32(x) * fp32(recip)) + fp32(offset)))."""
    s_b = round_to_bf16(Fraction(float(F32(input_scale))))
    recip = round_to_bf16(1 / s_b)
    off = round_to_bf16(Fraction(float(F32(input_offset))))
    x32 = np.asarray(x, dtype=F32)
    prod = x32 * F32(float(recip))  # recip is a bf16 value: exact in fp32
    y = prod + F32(float(off))
    return saturate_int8(rne_array(y))


def int_matmul(xq: np.ndarray, w_nk: np.ndarray) -> np.ndarray:
    """acc[m, n] = sum_k xq[m, k] * w[n, k] in int64 (exact)."""
    return np.asarray(xq, dtype=np.int64) @ np.asarray(w_nk, dtype=np.int64).T


def dequant(
    acc: np.ndarray,
    scale: np.ndarray,
    x_scale: np.ndarray | None = None,
    bias: np.ndarray | None = None,
    out: str = "bf16",
) -> np.ndarray:
    """npu_quant_matmul epilogue. Returns uint16 bf16 bits (out='bf16') or float32 (out='fp32').
    int bias (integer dtype) added to acc first; float bias added after the scales."""
    acc = np.asarray(acc, dtype=np.int64)
    if bias is not None and np.issubdtype(np.asarray(bias).dtype, np.integer):
        acc = acc + np.asarray(bias, dtype=np.int64)[None, :]
    y = acc.astype(F32)  # int -> fp32, round to nearest even
    y = y * np.asarray(scale, dtype=F32).reshape(1, -1)
    if x_scale is not None:
        y = y * np.asarray(x_scale, dtype=F32).reshape(-1, 1)
    if bias is not None and np.issubdtype(np.asarray(bias).dtype, np.floating):
        y = y + np.asarray(bias, dtype=F32).reshape(1, -1)
    return bf16_round_bits(y) if out == "bf16" else y


def grouped(xq, w_enk, scales, per_token, counts, out: str = "bf16"):
    """Per-expert loop: rows [sum(counts[:g]), sum(counts[:g+1])) use expert g."""
    M = xq.shape[0]
    N = w_enk.shape[1]
    res = np.zeros((M, N), dtype=np.uint16 if out == "bf16" else F32)
    start = 0
    for g, c in enumerate(counts):
        if c:
            acc = int_matmul(xq[start : start + c], w_enk[g])
            res[start : start + c] = dequant(acc, scales[g], per_token[start : start + c], out=out)
        start += c
    return res


def swiglu_clamped_f32(gate_up: np.ndarray, limit: float, silu) -> np.ndarray:
    """[.., 2I] -> fp32: silu(min(gate, L)) * clamp(up, -L, L); `silu` an fp32 -> fp32 function."""
    gu = np.asarray(gate_up, dtype=F32)
    I = gu.shape[-1] // 2
    g, u = gu[..., :I], gu[..., I:]
    if limit > 0:
        g = np.minimum(g, F32(limit))
        u = np.minimum(np.maximum(u, F32(-limit)), F32(limit))
    return (silu(g).astype(F32) * u).astype(F32)


def moe_chain(x, topk_ids, topk_weights, w13, s13, w2, s2, limit, silu):
    """The MoE W8A8 chain, bf16 throughout (as on the device), one token-slot at a time:
    q(x) -> gmm1 -> bf16 -> swiglu (fp32) -> bf16 -> q -> gmm2 -> bf16 -> weighted fp32 sum.
    Returns the per-(token, slot) expert outputs as fp32 [T, k, d] and the combined fp32 [T, d]."""
    xq, xs = dynamic_quant(x)
    T, k = topk_ids.shape
    d = w2.shape[1]
    per = np.zeros((T, k, d), dtype=F32)
    for t in range(T):
        for j in range(k):
            e = int(topk_ids[t, j])
            h = bf16_to_f32(dequant(int_matmul(xq[t : t + 1], w13[e]), s13[e], xs[t : t + 1]))
            a = bf16_to_f32(bf16_round_bits(swiglu_clamped_f32(h, limit, silu)))
            aq, a_s = dynamic_quant(a)
            per[t, j] = bf16_to_f32(dequant(int_matmul(aq, w2[e]), s2[e], a_s))[0]
    combined = np.zeros((T, d), dtype=np.float64)
    for t in range(T):
        for j in range(k):
            combined[t] += np.float64(F32(topk_weights[t, j])) * per[t, j].astype(np.float64)
    return per, combined
