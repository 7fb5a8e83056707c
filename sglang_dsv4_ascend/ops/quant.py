"""W8A8 INT8 numerics in plain PyTorch: the definition of the Ascend W8A8 bit rules.

Everything here runs on any torch device and is what the Triton kernels (`ops/triton/quant.py`)
and the torch_npu calls (`ops/npu.py`) must reproduce. Source of the rules:
docs/dsv4_reference.md §4.4 / §4.5 (CANN ops-nn golden references, op-plugin docs).

Bit rules (all "fp32" below is IEEE binary32 with round-to-nearest-even, no fused multiply-add):

* `dynamic_quant` (npu_dynamic_quant): per row m of x [M, K]:
      x32 = fp32(x) [* fp32(smooth) per column]
      amax_m = max_k |x32[m, k]|
      scale_m = amax_m * fp32(1/127)                       (one fp32 multiply)
      q[m, k] = saturate_int8(round_half_even(x32[m, k] / scale_m))   (IEEE fp32 division)
  |q| <= 127 (the amax element's quotient is 127 up to fp32 rounding, e.g. 127.00001 -> 127;
  -128 never occurs; saturation matters only for non-finite input or a subnormal scale). An
  all-zero row (scale 0, 0/0) gives scale 0 and q 0: a guard of this reference, UNVERIFIED on
  hardware. Same for a row whose scale underflows to 0.
* `static_quant` (npu_quantize, div_mode=False, as SGLang's NPUW8A8Int8LinearMethod calls it):
      recip = P(1 / P(input_scale))      P = the parameter dtype (bf16): both roundings in P
      off   = P(input_offset)
      q = saturate_int8(round_half_even(fp32(x) * fp32(recip) + fp32(off)))   (mul, then add)
  Whether the device fuses the multiply-add (one rounding) is unverified; this reference rounds
  after the multiply and after the add.
* `int8_matmul`: acc[m, n] = sum_k int(xq[m, k]) * int(w[n, k]), exact (the device accumulates
  in int32; |acc| <= K * 2^14, so no int32 overflow for K < 131072 = 2^17). Computed with
  torch._int_mm where a self-check passes, else an fp32/fp64 GEMM whose exactness is argued in
  `int8_matmul`'s docstring.
* `quant_matmul` (npu_quant_matmul), given acc:
      int32 bias: acc += bias[n]                            (integer add, BEFORE dequant)
      per-token path (x_scale given): y = (fp32(acc) * fp32(scale[n])) * x_scale[m]
      per-channel path:               y = fp32(acc) * fp32(scale[n])
      float bias: y += fp32(bias[n])                        (AFTER dequant)
      out = out_dtype(y), round to nearest even
  fp16 output on the per-channel path with a float scale, and int64 "deq" scales (ModelSlim fp16
  checkpoints): the scale used is the fp32 pattern masked with 0xFFFFE000 (mantissa truncated to
  10 bits); documented for fp16 output only, UNVERIFIED on hardware.
* `grouped_quant_matmul` (npu_grouped_matmul, split_item=2, group_type=0): rows of xq sorted by
  expert; expert g's rows [a_g, b_g) use w[g], scales[g] and the rows' per-token scales, with the
  `quant_matmul` per-token rule. Rows past the last group are 0 here (garbage on the device).
* `swiglu_clamped` (DeepSeek-V4): on [.., 2I] = [gate | up], computed in fp32, one final rounding:
      h = silu(min(gate, L)) * clamp(up, -L, L)            (gate clamped BEFORE SiLU)
* `moe_w8a8`: the MoE W8A8 chain
      route -> dynamic_quant(x) per token -> duplicate/sort rows by expert (stable)
      -> gmm1 (w13, per-token) in out dtype -> swiglu_clamped -> dynamic_quant (requant)
      -> gmm2 (w2, per-token) in out dtype -> out[t] = sum_j fp32(w[t, j]) * fp32(y[row(t, j)])
  The combine sums in fp32 in the order of the sorted rows; the device's finalize may sum in a
  different order, so compare the combine with a tolerance, everything before it bit for bit.

Choosing an implementation is the ops dispatcher's (`sglang_dsv4_ascend.ops.kernels(family)`): its
table holds each family's W8A8 ops and the weight layout its matmuls expect (`prepare_weight`,
applied once after loading): 'nk' = the checkpoint's [N, K] for the reference and Triton, 'kn' +
FRACTAL_NZ for the NPU. This module imports no other implementation.
"""

from __future__ import annotations

import functools
import logging
import time
from types import SimpleNamespace
from typing import Optional

import torch

from .. import settings
from .reference import swiglu_clamped as _reference_swiglu

INT8_MIN, INT8_MAX = -128, 127
INV_127 = torch.tensor(1.0 / 127.0, dtype=torch.float32)  # fp32(1/127), the constant the device uses

# |x| <= 128 and |w| <= 128 -> |x*w| <= 2^14. fp32 represents every integer up to 2^24, fp64 up to 2^53.
_MAX_ABS_PRODUCT = 128 * 128
FP32_EXACT_MAX_K = (1 << 24) // _MAX_ABS_PRODUCT  # 1024
FP64_EXACT_MAX_K = (1 << 53) // _MAX_ABS_PRODUCT  # 2^39
INT32_SAFE_MAX_K = ((1 << 31) - 1) // _MAX_ABS_PRODUCT  # 131071: the device's int32 accumulator
# torch 2.14's CPU torch._int_mm returns uninitialized memory for K == 1 (N >= 2), found by
# tests/unit/test_w8a8_ops.py; shorter K stays on the float path, where int_mm gains nothing anyway.
INT_MM_MIN_K = 16


def round_half_even(v: torch.Tensor) -> torch.Tensor:
    """torch.round is round-half-to-even (documented); named so the rule is visible."""
    return torch.round(v)


def saturate_int8(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(INT8_MIN, INT8_MAX).to(torch.int8)


# ----------------------------------------------------------------------------------------------
# activation quantization


def dynamic_quant(x: torch.Tensor, smooth: Optional[torch.Tensor] = None):
    """Per-token symmetric int8 (npu_dynamic_quant). x [..., K] -> (int8 [..., K], fp32 scale [...]).

    See the module docstring for the bit rule. All-zero rows -> scale 0, q 0 (unverified on hardware)."""
    x32 = x.float()
    if smooth is not None:
        x32 = x32 * smooth.float()
    amax = x32.abs().amax(dim=-1)
    scale = amax * INV_127.to(x32.device)
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    q = saturate_int8(round_half_even(x32 / safe.unsqueeze(-1)))
    q = q.masked_fill((scale == 0).unsqueeze(-1), 0)
    return q, scale


def static_recip_offset(input_scale: torch.Tensor, input_offset: torch.Tensor, param_dtype=torch.bfloat16):
    """SGLang's load-time transform for static W8A8: (P(1 / P(scale)), P(offset)), P = param dtype."""
    s = input_scale.to(param_dtype).float()
    recip = (1.0 / s).to(param_dtype)
    return recip, input_offset.to(param_dtype)


def static_quant(
    x: torch.Tensor, input_scale: torch.Tensor, input_offset: torch.Tensor, param_dtype=torch.bfloat16
) -> torch.Tensor:
    """Per-tensor static int8 as SGLang runs it on the NPU (npu_quantize, div_mode=False):
    q = saturate_int8(round_half_even(fp32(x) * fp32(recip) + fp32(offset))) with
    recip = P(1 / P(input_scale)), P = the parameter dtype (bf16 for a bf16 model).

    input_scale / input_offset: [1] (per tensor) or [K] (already expanded); offset integer-valued."""
    recip, off = static_recip_offset(input_scale, input_offset, param_dtype)
    y = x.float() * recip.float()
    y = y + off.float()
    return saturate_int8(round_half_even(y))


# ----------------------------------------------------------------------------------------------
# integer matmul


def _fp32_gemm_is_ieee(device: torch.device) -> bool:
    """fp32 GEMM is exact on integer data only if it really runs in fp32 (no TF32 / bf16 passes)."""
    if torch.get_float32_matmul_precision() != "highest":
        return False
    if device.type == "cuda":
        return not torch.backends.cuda.matmul.allow_tf32
    return device.type == "cpu"


@functools.lru_cache(maxsize=None)
def int_mm_exact_on_cpu() -> bool:
    """One-time self-check of torch._int_mm on this CPU backend against the provably exact fp64
    product, on patterns that break non-exact int8 kernels (u8*s8 pair sums that saturate int16 in
    some non-VNNI paths, sums past 2^24, -128 * -128) and on gemv / small / blocked shapes."""
    try:
        g = torch.Generator().manual_seed(0)
        for M, K, N in ((1, 1040, 8), (3, INT_MM_MIN_K, 5), (17, 4100, 24), (64, 64, 40)):
            x = torch.randint(-128, 128, (M + 3, K), dtype=torch.int8, generator=g)
            w = torch.randint(-128, 128, (N + 3, K), dtype=torch.int8, generator=g)
            x[0], x[1], x[2, ::2], x[2, 1::2] = 127, -128, 127, -128
            w[0], w[1], w[2, ::2], w[2, 1::2] = 127, -128, -128, 127
            for wk in (w.t(), w.t().contiguous()):
                if not torch.equal(torch._int_mm(x, wk).double(), x.double() @ w.double().t()):
                    return False
        return True
    except (RuntimeError, TypeError):
        return False


# ----------------------------------------------------------------------------------------------
# choosing the integer matmul: the fastest exact implementation, measured on this machine

M_BUCKETS = (1, 16, 256)  # decode rows, small batches / verify, prefill chunks
PROBE_MAX_M = 32  # rows of the probe for the prefill bucket (its cost, not its ranking, grows with M)
PROBE_MAX_N = 2048  # columns: the ranking depends on N through cache sizes, so probe near the real N
PROBE_BUDGET_S = 2.0  # per process (each probe stays well under a second); then the float path
_probe_spent = [0.0]
_methods: dict = {}  # (device type, M bucket, K bucket, N bucket) -> {"method", "us", "why"}
logger = logging.getLogger("sglang_dsv4_ascend")


def _bucket(v: int, buckets) -> int:
    return next((b for b in buckets if v <= b), buckets[-1])


def _k_bucket(K: int) -> int:
    return 1 << max(0, K - 1).bit_length()


def _exact_candidates(device: torch.device, K: int) -> dict:
    """name -> fn(xq [M, K], wk [K, N]) for the exact int8 GEMMs available for K on `device`.
    `_int_mm` counts only on CPU after its self-check (its CUDA kernel has shape rules of its own;
    the CUDA family's W8A8 GEMM is the Triton kernel in ops/triton/quant.py)."""
    out = {"float": lambda x, wk: int8_matmul(x, wk, w_layout="kn", method="float")}
    if device.type == "cpu" and INT_MM_MIN_K <= K <= INT32_SAFE_MAX_K and int_mm_exact_on_cpu():
        out["int_mm"] = lambda x, wk: int8_matmul(x, wk, w_layout="kn", method="int_mm")
    return out


def _time(fn, x, wk, beat_s: float) -> float:
    """Best of up to three runs (after a warm-up) in microseconds; a candidate already 4x slower
    than the best so far (`beat_s`), warm-up included, is not run again."""
    t = time.perf_counter()
    fn(x, wk)
    best = time.perf_counter() - t
    if best > 4 * beat_s:
        return best * 1e6
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        fn(x, wk)
        best = min(best, time.perf_counter() - t)
        if best > 4 * beat_s:
            break
    return best * 1e6


def probe_int8_method(device, m_bucket: int, K: int, N: int = PROBE_MAX_N, candidates=None) -> dict:
    """Time every exact candidate on a synthetic [min(m, 32), K] x [K, min(N, 2048)] problem and
    return {"method": fastest, "us": {name: microseconds}, "why": text}."""
    device = torch.device(device)
    candidates = candidates or _exact_candidates(device, K)
    if len(candidates) == 1:
        (name,) = candidates
        return {"method": name, "us": {}, "why": f"only exact method for K={K} on {device.type}"}
    g = torch.Generator().manual_seed(K)
    x = torch.randint(-128, 128, (min(m_bucket, PROBE_MAX_M), K), dtype=torch.int8, generator=g).to(device)
    n = min(N, PROBE_MAX_N)
    wk = torch.randint(-128, 128, (K, n), dtype=torch.int8, generator=g).to(device)
    us = {}
    for name, fn in candidates.items():
        us[name] = _time(fn, x, wk, min(us.values(), default=float("inf")) / 1e6)
    best = min(us, key=us.get)
    shown = ", ".join(f"{k} {t:.0f} us" for k, t in sorted(us.items(), key=lambda kv: kv[1]))
    return {"method": best, "us": us, "why": f"fastest exact on a {x.shape[0]}x{K}x{n} probe: {shown}"}


def int8_method(device, M: int, K: int, N: int) -> str:
    """The method 'auto' resolves to for an [M, K] x [K, N] int8 GEMM on `device` (probed once per
    shape class, logged; SGLANG_DSV4_INT8_MATMUL=int_mm|float forces one where it is exact)."""
    device = torch.device(device)
    forced = settings.INT8_MATMUL.get()
    if forced != "auto":
        return forced if forced in _exact_candidates(device, K) else "float"
    key = shape_class(device, M, K, N)
    if key not in _methods:
        if _probe_spent[0] >= PROBE_BUDGET_S:
            _methods[key] = {"method": "float", "us": {}, "why": "probe budget spent: the always-exact float path"}
        else:
            t0 = time.perf_counter()
            _methods[key] = probe_int8_method(device, key[1], key[2], key[3])
            _probe_spent[0] += time.perf_counter() - t0
        logger.info(
            "W8A8 int8 GEMM on %s, M<=%d, K<=%d, N<=%d: %s (%s)", *key, _methods[key]["method"], _methods[key]["why"]
        )
    return _methods[key]["method"]


def shape_class(device, M: int, K: int, N: int) -> tuple:
    return (torch.device(device).type, _bucket(M, M_BUCKETS), _k_bucket(K), _k_bucket(min(N, PROBE_MAX_N)))


def plan_int8_methods(device, shapes) -> dict:
    """Probe every M bucket for each (K, N) of a model's W8A8 GEMMs (called once after loading, so
    the first requests do not pay the probe); -> {(M bucket, K, N): method}."""
    return {(m, K, N): int8_method(device, m, K, N) for K, N in sorted(set(shapes)) for m in M_BUCKETS}


def int8_choices() -> dict:
    """What 'auto' chose so far: {shape_class(...): {"method", "us", "why"}}."""
    return dict(_methods)


def int8_matmul(xq: torch.Tensor, w: torch.Tensor, *, w_layout: str = "nk", method: str = "auto") -> torch.Tensor:
    """Exact integer product of int8 xq [M, K] and int8 weights, as float64 [M, N] holding integers.

    w_layout: 'nk' = w is [N, K] (checkpoint layout, y = xq @ w.T); 'kn' = w is [K, N].

    method:
      'float' - the provably exact path without an integer GEMM. Every product |x*w| <= 128*128 =
          2^14, so any partial sum over at most k terms is an integer of magnitude <= k * 2^14. An
          IEEE format with p significand bits represents every integer up to 2^p, so when
          k * 2^14 <= 2^p every addition, in any order and with or without FMA, produces an exactly
          representable integer and nothing is ever rounded:
            * fp32 GEMM for K <= 1024 (= 2^24 / 2^14), when fp32 GEMM really runs in IEEE fp32
              (float32_matmul_precision 'highest'; no TF32 on CUDA);
            * otherwise fp64 GEMM, exact for K <= 2^39 (asserted).
      'fp64'  - always the fp64 GEMM.
      'int_mm' - torch._int_mm: int32 accumulation, the device's own semantics (K < 131072 so no
          int32 overflow). Exact by contract; its correctness is the backend kernel's: torch 2.14
          on CPU returns garbage for K == 1, so K < INT_MM_MIN_K (16) takes the 'float' path.
      'auto'  - the fastest exact method for this device, row count and K, measured once by a short
          timed probe (`int8_method`); exactness alone does not decide: on an AVX2 CPU without
          VNNI/AMX, `_int_mm` is exact but 4-45x slower than the float path, on AMX it is 5-40x
          faster. tests/unit/test_w8a8_ops.py checks every method against an int64 oracle."""
    if xq.dtype != torch.int8 or w.dtype != torch.int8:
        raise TypeError(f"int8_matmul takes int8 operands, got {xq.dtype} and {w.dtype}")
    wk = w if w_layout == "kn" else w.transpose(-2, -1) if w_layout == "nk" else None
    if wk is None:
        raise ValueError(f"w_layout must be 'nk' or 'kn', got {w_layout!r}")
    K = xq.shape[-1]
    if wk.shape[-2] != K:
        raise ValueError(f"int8_matmul: x has K={K} but the weight ({w_layout}) has shape {tuple(w.shape)}")
    if method == "auto":
        method = int8_method(xq.device, xq.numel() // K, K, wk.shape[-1])
    if method == "int_mm" and K < INT_MM_MIN_K:
        method = "float"
    if method == "int_mm":
        if K > INT32_SAFE_MAX_K:
            raise ValueError(f"K={K} may overflow an int32 accumulator (max {INT32_SAFE_MAX_K})")
        return torch._int_mm(xq.contiguous(), wk).double()
    if method not in ("float", "fp64"):
        raise ValueError(f"method must be 'auto', 'float', 'fp64' or 'int_mm', got {method!r}")
    assert K <= FP64_EXACT_MAX_K, f"K={K} exceeds the fp64 exactness bound {FP64_EXACT_MAX_K}"
    if method == "float" and K <= FP32_EXACT_MAX_K and _fp32_gemm_is_ieee(xq.device):
        return (xq.float() @ wk.float()).double()
    return xq.double() @ wk.double()


# ----------------------------------------------------------------------------------------------
# dequantization (npu_quant_matmul's epilogue)


def deq_scale_int64_to_fp32(deq: torch.Tensor) -> torch.Tensor:
    """ModelSlim fp16-model deq_scale: int64 whose low 32 bits hold an fp32 bit pattern; the
    device reads it with the mantissa truncated to 10 bits (mask 0xFFFFE000). UNVERIFIED on hardware."""
    bits = deq.to(torch.int64) & 0xFFFFE000
    bits = torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)  # low 32 bits, signed
    return bits.view(torch.float32)


def deq_scale_fp32_to_int64(scale: torch.Tensor) -> torch.Tensor:
    """Inverse storage transform: fp32 -> int64 holding the (untruncated) fp32 bits."""
    return scale.float().contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def _truncate_fp16_deq(scale32: torch.Tensor) -> torch.Tensor:
    bits = scale32.contiguous().view(torch.int32) & torch.tensor(-8192, dtype=torch.int32)  # 0xFFFFE000
    return bits.view(torch.float32)


def dequant(
    acc: torch.Tensor,
    scale: torch.Tensor,
    x_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    out_dtype=torch.bfloat16,
) -> torch.Tensor:
    """npu_quant_matmul's epilogue on an exact accumulator (any dtype holding integers, [M, N]).

    scale: [N] or [N, 1] (bf16 / fp32: upcast exactly; int64: ModelSlim deq format);
    x_scale: fp32 per-token [M] or None; bias: int32 [N] (added to acc) or float [N] (added after)."""
    acc = acc.double() if acc.dtype != torch.float64 else acc
    if bias is not None and not bias.is_floating_point():
        acc = acc + bias.reshape(-1).double()  # exact: integers far below 2^53
    scale = scale.reshape(-1)
    if scale.dtype == torch.int64:
        s32 = deq_scale_int64_to_fp32(scale)
    else:
        s32 = scale.float()
        if out_dtype == torch.float16 and x_scale is None and (bias is None or not bias.is_floating_point()):
            s32 = _truncate_fp16_deq(s32)
    y = acc.float() * s32  # fp64 -> fp32 conversion rounds to nearest even, like int32 -> fp32
    if x_scale is not None:
        y = y * x_scale.reshape(-1, 1).float()
    if bias is not None and bias.is_floating_point():
        y = y + bias.reshape(-1).float()
    return y.to(out_dtype)


def quant_matmul(
    xq: torch.Tensor,
    wq: torch.Tensor,
    w_scale: torch.Tensor,
    x_scale: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    out_dtype=torch.bfloat16,
    *,
    w_layout: str = "nk",
    method: str = "auto",
) -> torch.Tensor:
    """npu_quant_matmul: out_dtype(dequant(exact int product)). xq int8 [M, K]; wq int8 [N, K] ('nk')
    or [K, N] ('kn'); w_scale [N] (per-token path: the weight scale; static path: deq_scale);
    x_scale fp32 [M] per-token scale or None; bias int32 (before dequant) or float (after)."""
    return dequant(int8_matmul(xq, wq, w_layout=w_layout, method=method), w_scale, x_scale, bias, out_dtype)


def group_bounds(group_list: torch.Tensor, group_list_type: int) -> list:
    """[(start, end)] per expert from npu_grouped_matmul's group_list: type 0 = cumulative end
    offsets, type 1 = per-expert counts."""
    g = [int(v) for v in group_list.tolist()]
    if group_list_type == 1:
        ends, acc = [], 0
        for c in g:
            acc += c
            ends.append(acc)
    elif group_list_type == 0:
        ends = g
    else:
        raise ValueError(f"group_list_type must be 0 (cumsum) or 1 (counts), got {group_list_type}")
    bounds, start = [], 0
    for e in ends:
        if e < start:
            raise ValueError(f"group_list must be non-decreasing cumulative ends, got {g}")
        bounds.append((start, e))
        start = e
    return bounds


def grouped_quant_matmul(
    xq: torch.Tensor,
    w: torch.Tensor,
    scales: torch.Tensor,
    per_token: torch.Tensor,
    group_list: torch.Tensor,
    group_list_type: int = 0,
    out_dtype=torch.bfloat16,
    *,
    w_layout: str = "nk",
    method: str = "auto",
) -> torch.Tensor:
    """npu_grouped_matmul (int8, per-token, single output): xq int8 [M, K] sorted by expert;
    w int8 [E, N, K] ('nk') or [E, K, N] ('kn'); scales [E, N] (or [E, N, 1]); per_token fp32 [M].
    Rows past the last group are 0 (the device leaves them unwritten)."""
    E = w.shape[0]
    N = w.shape[1] if w_layout == "nk" else w.shape[2]
    bounds = group_bounds(group_list, group_list_type)
    if len(bounds) != E:
        raise ValueError(f"group_list has {len(bounds)} groups for {E} experts")
    if bounds and bounds[-1][1] > xq.shape[0]:
        raise ValueError(f"group_list covers {bounds[-1][1]} rows but xq has {xq.shape[0]}")
    out = torch.zeros(xq.shape[0], N, dtype=out_dtype, device=xq.device)
    for g, (a, b) in enumerate(bounds):
        if b > a:
            out[a:b] = quant_matmul(
                xq[a:b], w[g], scales[g], per_token[a:b], None, out_dtype, w_layout=w_layout, method=method
            )
    return out


# ----------------------------------------------------------------------------------------------
# MoE W8A8 chain


def swiglu_clamped(gate_up: torch.Tensor, limit: float, out_dtype=None) -> torch.Tensor:
    """DeepSeek-V4 SwiGLU on [..., 2I] = [gate | up] in fp32, rounded once to out_dtype (default:
    the input dtype): h = silu(min(gate, L)) * clamp(up, -L, L). limit <= 0 disables the clamp.
    (SGLang's NPUSwigluStepAndMul clamps after SiLU and its int8 MoE path not at all: §4.2.)"""
    g, u = gate_up.float().chunk(2, dim=-1)  # the reference op is the one definition of V4's clamp
    return _reference_swiglu(g, u, limit).to(out_dtype or gate_up.dtype)


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int):
    """Token duplication + stable sort by expert (npu_moe_init_routing): returns
    (rows [T*k] token index of each sorted row, order [T*k] flat (token, slot) index, counts [E]).
    Ids outside [0, E) (another EP rank's experts) are keyed E: sorted after every group, so they
    lie past the group_list and no grouped matmul spends work on them. Counts come from a
    fixed-size scatter (bincount's output size depends on the data: a host sync on a device)."""
    flat = topk_ids.reshape(-1).long()
    flat = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    order = torch.sort(flat, stable=True).indices
    k = topk_ids.shape[-1]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return order // k, order, counts[:num_experts]


def moe_w8a8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    w13: torch.Tensor,
    w13_scale: torch.Tensor,
    w2: torch.Tensor,
    w2_scale: torch.Tensor,
    limit: float,
    out_dtype=None,
    ops=None,
) -> torch.Tensor:
    """The routed-expert W8A8 chain (module docstring). x [T, d]; topk_ids/weights [T, k];
    w13 [E, 2I, d] (gate rows first), w2 [E, d, I] in the `ops` bundle's weight layout;
    scales [E, 2I] / [E, d]; `ops`: a kernel family's table (`ops.kernels(...)`; default: this module's
    reference ops). Ids outside [0, E) are copies for another EP rank's experts: they
    contribute nothing here. Returns fp32 [T, d] (the caller adds the shared expert and casts)."""
    ops = ops or _REFERENCE
    out_dtype = out_dtype or x.dtype
    E = w13.shape[0]
    xq, xs = ops.dynamic_quant(x)
    rows, order, counts = sort_by_expert(topk_ids, E)
    group_list = torch.cumsum(counts, 0)
    h = ops.grouped_quant_matmul(xq[rows], w13, w13_scale, xs[rows], group_list, 0, out_dtype)
    a = swiglu_clamped(h, limit, out_dtype)
    aq, a_s = ops.dynamic_quant(a)
    y = ops.grouped_quant_matmul(aq, w2, w2_scale, a_s, group_list, 0, out_dtype)
    flat = topk_ids.reshape(-1)[order]
    here = (flat >= 0) & (flat < E)
    # rows past the group_list are left unwritten by the device op: select, never multiply, them away
    contrib = torch.where(here[:, None], y.float() * topk_weights.reshape(-1)[order].float()[:, None], 0.0)
    out = torch.zeros(x.shape[0], y.shape[-1], dtype=torch.float32, device=x.device)
    out.index_add_(0, rows, contrib)
    return out


# moe_w8a8's default ops: the definitions above (the dispatcher's 'reference' table holds the same)
_REFERENCE = SimpleNamespace(dynamic_quant=dynamic_quant, grouped_quant_matmul=grouped_quant_matmul)

__all__ = [
    "dequant",
    "deq_scale_fp32_to_int64",
    "deq_scale_int64_to_fp32",
    "dynamic_quant",
    "group_bounds",
    "grouped_quant_matmul",
    "int8_matmul",
    "moe_w8a8",
    "quant_matmul",
    "round_half_even",
    "saturate_int8",
    "sort_by_expert",
    "static_quant",
    "static_recip_offset",
    "swiglu_clamped",
]
