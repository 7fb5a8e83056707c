"""W8A8 ops (ops/quant.py reference, ops/triton/quant.py under the interpreter) against the
independent oracle in tests/oracles/w8a8_oracle.py, bit for bit.

Each adversarial input is paired with a deliberately broken variant of the rule it targets
(round half away from zero, dequant in bf16, int32 bias after dequant, other multiply order, fp32
GEMM past its exactness bound, clamp after SiLU): the broken variant must disagree with the oracle
on that input, which proves the input can tell a right implementation from a wrong one."""

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from oracles import w8a8_oracle as O

from sglang_dsv4_ascend import ops
from sglang_dsv4_ascend import settings as dsv4_settings
from sglang_dsv4_ascend.ops import quant as Q

HYP = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _np(t):
    return t.detach().float().numpy() if t.is_floating_point() else t.detach().numpy()


def _bits(t_bf16):
    return t_bf16.contiguous().view(torch.int16).numpy().view(np.uint16)


def _assert_dynamic_matches(x, smooth=None):
    q, s = Q.dynamic_quant(x, smooth)
    oq, os_ = O.dynamic_quant(_np(x), None if smooth is None else _np(smooth))
    np.testing.assert_array_equal(q.numpy().astype(np.int64), oq)
    np.testing.assert_array_equal(s.numpy().view(np.uint32), os_.view(np.uint32))
    return q, s


# ------------------------------------------------------------------------------------------------
# inputs


def tie_rows(n_rows=4, K=256, seed=0):
    """bf16 rows whose amax is 127 (scale = 127 * fp32(1/127) = 1.0 exactly), so x / scale = x and
    every k + 0.5 in the row is an exact tie."""
    assert float(torch.tensor(127.0) * Q.INV_127) == 1.0
    g = torch.Generator().manual_seed(seed)
    k = torch.randint(-126, 126, (n_rows, K), generator=g).float()
    x = k + 0.5
    x[:, 0] = 127.0  # amax
    return x.bfloat16()


def near_tie_row(amax=3.7, K=2048):
    """fp32 row with a non-trivial scale whose quotients x / scale land on or 1-2 ulps around
    k + 0.5: where dividing and multiplying by the reciprocal can round to different integers."""
    a = np.float32(amax)
    s = np.float32(a * (np.float32(1) / np.float32(127)))
    vals = [a]
    for k in range(-126, 126):
        x0 = np.float32((k + 0.5) * s)
        for _ in range(2):
            vals.append(x0)
            x0 = np.nextafter(x0, np.float32(np.inf), dtype=np.float32)
        vals.append(np.nextafter(np.float32((k + 0.5) * s), np.float32(-np.inf), dtype=np.float32))
    vals = np.array(vals[:K], dtype=np.float32)
    return torch.from_numpy(vals)[None, :]


def adversarial_rows():
    """Zero rows, a huge/tiny mixed row, negative ties, a single-element row pattern."""
    x = torch.randn(6, 96) * 3
    x[1] = 0.0
    x[2, :] = 1e-30
    x[2, 5] = 1e30
    x[3] = -x[3].abs()
    x[4] = torch.linspace(-1, 1, 96)
    x[5] = 0.0
    x[5, 7] = -2.0
    return x


# ------------------------------------------------------------------------------------------------
# dynamic quant


def test_dynamic_quant_random_bf16_fp32_fp16():
    g = torch.Generator().manual_seed(1)
    for dt in (torch.bfloat16, torch.float32, torch.float16):
        x = (torch.randn(64, 300, generator=g) * 5).to(dt)
        _assert_dynamic_matches(x)


def test_dynamic_quant_smooth_scales():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(16, 128, generator=g).bfloat16()
    smooth = torch.rand(128, generator=g) + 0.25
    _assert_dynamic_matches(x, smooth)


def test_dynamic_quant_ties_round_half_even_and_broken_variant_is_caught():
    x = tie_rows()
    q, s = _assert_dynamic_matches(x)
    assert torch.all(s == 1.0)
    ties = (x.float() - x.float().floor()) == 0.5
    assert int(ties.sum()) > 500, "the input must contain many exact ties"
    # Broken: round half away from zero.
    v = x.float() / s[:, None]
    broken = (torch.sign(v) * torch.floor(v.abs() + 0.5)).clamp(-128, 127).to(torch.int8)
    assert not np.array_equal(broken.numpy().astype(np.int64), O.dynamic_quant(_np(x))[0])
    # Broken: multiply by the reciprocal instead of dividing (differs on near-tie quotients).
    xr = near_tie_row()
    _assert_dynamic_matches(xr)
    _, sr = Q.dynamic_quant(xr)
    mul = torch.round(xr * (1.0 / sr)[:, None]).clamp(-128, 127).to(torch.int8)
    assert not np.array_equal(mul.numpy().astype(np.int64), O.dynamic_quant(_np(xr))[0])


def test_dynamic_quant_zero_and_extreme_rows():
    q, s = _assert_dynamic_matches(adversarial_rows())
    assert s[1] == 0 and torch.all(q[1] == 0)  # documented guard (unverified on hardware)
    assert q[2, 5] == 127 and torch.all(q[2, :5] == 0)
    assert q[5, 7] == -127 and int(q[5].abs().sum()) == 127
    assert int(q.min()) >= -127  # dynamic quant never reaches -128


@HYP
@given(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=2, max_dims=2, min_side=1, max_side=40),
        elements=st.floats(-1e4, 1e4, width=32),
    )
)
def test_dynamic_quant_property(x):
    _assert_dynamic_matches(torch.from_numpy(x.copy()))


# ------------------------------------------------------------------------------------------------
# static quant (SGLang: recip = bf16(1 / bf16(scale)), npu_quantize div_mode=False)


def test_static_quant_matches_oracle_with_saturation_and_offset():
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(32, 200, generator=g) * 4).bfloat16()
    x[0, :10] = 1e4  # saturates at 127
    x[1, :10] = -1e4  # saturates at -128
    for scale, offset in [(0.03, 0.0), (0.0173, -7.0), (0.11, 12.0), (1 / 127, 0.0)]:
        q = Q.static_quant(x, torch.tensor([scale]), torch.tensor([offset]))
        np.testing.assert_array_equal(q.numpy().astype(np.int64), O.static_quant(_np(x), scale, offset))
        assert int(q.max()) == 127 and int(q.min()) == -128
    # Broken: exact fp32 reciprocal instead of SGLang's bf16-rounded one must differ.
    scale = 0.0173
    broken = torch.round(x.float() / scale).clamp(-128, 127).to(torch.int8)
    assert not np.array_equal(broken.numpy().astype(np.int64), O.static_quant(_np(x), scale, 0.0))


@HYP
@given(
    hnp.arrays(np.float32, (3, 17), elements=st.floats(-50, 50, width=32)),
    st.floats(0.0009765625, 1.0, width=32),
    st.integers(-20, 20),
)
def test_static_quant_property(x, scale, offset):
    q = Q.static_quant(torch.from_numpy(x.copy()), torch.tensor([scale]), torch.tensor([float(offset)]))
    np.testing.assert_array_equal(q.numpy().astype(np.int64), O.static_quant(x, scale, offset))


# ------------------------------------------------------------------------------------------------
# int8 matmul


def _rand_i8(shape, seed):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("K", [1, 7, 256, 1024, 1025, 4096])
def test_int8_matmul_exact_random(K):
    x, w = _rand_i8((9, K), K), _rand_i8((13, K), K + 1)
    acc = Q.int8_matmul(x, w)
    np.testing.assert_array_equal(acc.numpy().astype(np.int64), O.int_matmul(x.numpy(), w.numpy()))
    for method in ("float", "int_mm"):
        assert torch.equal(Q.int8_matmul(x, w.t().contiguous(), w_layout="kn", method=method), acc)


def _exactness_adversary(K):
    """Extremes that an inexact accumulation gets wrong: x[0] = 127 against w[0] = [127]*(K-16) +
    [1]*16 (partial sums pass 2^24, then odd terms arrive); x[2] = [-128]*(K-1) + [127] against
    w[4] = [-128]*(K-1) + [1] (2^14 (K-1) + 127: odd and > 2^24 from K = 1025 on, so no fp32 sum
    can hold it); x[1] = -128 against w[3] = -128 (|acc| = K 2^14, exactly 2^24 at K = 1024)."""
    x = torch.full((3, K), 127, dtype=torch.int8)
    x[1] = -128
    x[2] = -128
    x[2, -1] = 127
    w = torch.full((5, K), 127, dtype=torch.int8)
    w[:, -16:] = 1
    w[1] = -128
    w[1, -16:] = -1
    w[2, -5:] = -127
    w[3] = -128
    w[4] = -128
    w[4, -1] = 1
    return x, w


@pytest.mark.parametrize("K", [1024, 1025, 4096, 16384, 65536])
def test_int8_matmul_exact_at_and_past_the_fp32_bound(K):
    x, w = _exactness_adversary(K)
    exact = O.int_matmul(x.numpy(), w.numpy())
    assert np.abs(exact).max() == K * 128 * 128  # == 2^24 at the fp32 bound K = 1024
    for method in ("auto", "float", "fp64", "int_mm"):
        np.testing.assert_array_equal(Q.int8_matmul(x, w, method=method).numpy().astype(np.int64), exact)
    if K > Q.FP32_EXACT_MAX_K:
        # Broken: an fp32 GEMM past its bound rounds.
        broken = (x.float() @ w.float().t()).double()
        assert not np.array_equal(broken.numpy().astype(np.int64), exact)


@pytest.mark.parametrize("M", [1, 2, 23, 70])
@pytest.mark.parametrize("K", [64, 1024, 4096, 65536])
def test_torch_int_mm_is_exact_here(K, M):
    """'auto' uses torch._int_mm on CPU when its self-check passes: check it on this machine's
    backend for gemv and gemm shapes, including the u8*s8 pair sums that saturate int16 in some
    non-VNNI int8 kernels (x = 127 against w = 127 / -128)."""
    x, w = _exactness_adversary(K)
    x = torch.cat([x, _rand_i8((M, K), 7)])[: max(M, 3)]
    exact = O.int_matmul(x.numpy(), w.numpy())
    np.testing.assert_array_equal(Q.int8_matmul(x, w, method="int_mm").numpy().astype(np.int64), exact)
    for row in range(x.shape[0]):  # one row at a time: the gemv kernels
        got = Q.int8_matmul(x[row : row + 1], w, method="int_mm").numpy().astype(np.int64)
        np.testing.assert_array_equal(got, exact[row : row + 1])


def test_int_mm_k1_bug_is_routed_around():
    """torch 2.14's CPU _int_mm returns uninitialized values for K == 1 (N >= 2): int8_matmul must
    not use it there, whatever the method."""
    x, w = _rand_i8((3, 1), 1), _rand_i8((4, 1), 2)
    exact = O.int_matmul(x.numpy(), w.numpy())
    for method in ("auto", "int_mm"):
        np.testing.assert_array_equal(Q.int8_matmul(x, w, method=method).numpy().astype(np.int64), exact)


def test_auto_method_is_exact_and_bad_methods_are_named():
    x, w = _rand_i8((2, 8), 1), _rand_i8((3, 8), 2)
    assert torch.equal(Q.int8_matmul(x, w), Q.int8_matmul(x, w, method="float"))
    with pytest.raises(ValueError, match="method must be"):
        Q.int8_matmul(x, w, method="magic")


def test_int_mm_self_check_rejects_a_wrong_kernel(monkeypatch):
    """The self-check must catch an _int_mm that is wrong (here: int16 pair-sum saturation), and
    a kernel that fails it is never a candidate."""
    real = torch._int_mm

    def saturating(a, b):
        return real(a, b).clamp(-(2**15), 2**15 - 1)

    Q.int_mm_exact_on_cpu.cache_clear()
    try:
        monkeypatch.setattr(torch, "_int_mm", saturating)
        assert Q.int_mm_exact_on_cpu() is False
        assert "int_mm" not in Q._exact_candidates(torch.device("cpu"), 64)
    finally:
        monkeypatch.undo()
        Q.int_mm_exact_on_cpu.cache_clear()
    assert Q.int_mm_exact_on_cpu() is True  # the real kernel passes on this machine's torch


def _slow(fn, seconds):
    def run(x, wk):
        time.sleep(seconds)
        return fn(x, wk)

    return run


@pytest.mark.parametrize("slow", ["float", "int_mm"])
def test_probe_picks_the_faster_exact_method(slow):
    """Whichever candidate is made deliberately slow loses, whatever this CPU's natural order."""
    cands = Q._exact_candidates(torch.device("cpu"), 256)
    assert set(cands) == {"float", "int_mm"}
    # 50 ms per call: far above what a 16x256x256 GEMM costs even on a loaded CI machine
    cands[slow] = _slow(cands[slow], 0.05)
    got = Q.probe_int8_method("cpu", 16, 256, 256, candidates=cands)
    assert got["method"] == ({"float", "int_mm"} - {slow}).pop()
    assert got["us"][slow] >= 50000 and "fastest exact" in got["why"]


def test_auto_uses_the_probe_once_per_shape_class_and_env_forces(monkeypatch):
    calls = []
    monkeypatch.setattr(Q, "_methods", {})
    monkeypatch.setattr(Q, "_probe_spent", [0.0])

    def fake_probe(device, m, K, N, candidates=None):
        calls.append((m, K, N))
        return {"method": "int_mm" if m == 1 else "float", "us": {}, "why": "test"}

    monkeypatch.setattr(Q, "probe_int8_method", fake_probe)
    assert Q.int8_method("cpu", 1, 100, 5) == "int_mm" and Q.int8_method("cpu", 1, 128, 8) == "int_mm"
    assert Q.int8_method("cpu", 9, 100, 5) == "float" and Q.int8_method("cpu", 300, 100, 5) == "float"
    assert calls == [(1, 128, 8), (16, 128, 8), (256, 128, 8)]  # K 100/128 and N 5/8 share classes; M 9 -> 16
    x, w = _rand_i8((1, 100), 3), _rand_i8((5, 100), 4)
    exact = O.int_matmul(x.numpy(), w.numpy())
    np.testing.assert_array_equal(Q.int8_matmul(x, w).numpy().astype(np.int64), exact)
    monkeypatch.setenv(dsv4_settings.INT8_MATMUL.name, "float")
    assert Q.int8_method("cpu", 1, 100, 5) == "float"
    monkeypatch.setenv(dsv4_settings.INT8_MATMUL.name, "int_mm")
    assert Q.int8_method("cpu", 1, 8, 5) == "float"  # forced, but not exact for K < 16: never used there
    monkeypatch.setenv(dsv4_settings.INT8_MATMUL.name, "fast")
    with pytest.raises(ValueError, match="SGLANG_DSV4_INT8_MATMUL='fast'"):
        Q.int8_method("cpu", 1, 100, 5)


def test_probe_budget_bounds_the_cost(monkeypatch):
    monkeypatch.setattr(Q, "_methods", {})
    monkeypatch.setattr(Q, "_probe_spent", [Q.PROBE_BUDGET_S])
    assert Q.int8_method("cpu", 16, 512, 512) == "float"
    assert "budget" in Q.int8_choices()[("cpu", 16, 512, 512)]["why"]


def test_real_probe_is_bounded_and_exact():
    """DSV4-Flash's largest K and N on this path: the probe times a capped problem (at most
    PROBE_MAX_M rows and PROBE_MAX_N columns), never the full GEMM, with the real kernels."""
    shapes = []

    def record(fn):
        def run(x, wk):
            shapes.append((tuple(x.shape), tuple(wk.shape)))
            return fn(x, wk)

        return run

    cands = {k: record(f) for k, f in Q._exact_candidates(torch.device("cpu"), 4096).items()}
    got = Q.probe_int8_method("cpu", 256, 4096, 32768, candidates=cands)
    assert shapes and all(x[0] <= Q.PROBE_MAX_M and w == (4096, Q.PROBE_MAX_N) for x, w in shapes), shapes
    assert got["method"] in got["us"] and set(got["us"]) == set(cands)


@HYP
@given(st.integers(1, 5), st.integers(1, 70), st.integers(1, 9), st.integers(0, 2**31 - 1))
def test_int8_matmul_property(M, K, N, seed):
    x, w = _rand_i8((M, K), seed), _rand_i8((N, K), seed + 1)
    exact = O.int_matmul(x.numpy(), w.numpy())
    for method in ("auto", "float", "int_mm"):
        np.testing.assert_array_equal(Q.int8_matmul(x, w, method=method).numpy().astype(np.int64), exact)


# ------------------------------------------------------------------------------------------------
# quant_matmul (dequant epilogue)


def _qm_inputs(seed=5, M=24, K=512, N=48):
    g = torch.Generator().manual_seed(seed)
    xq, xs = Q.dynamic_quant(torch.randn(M, K, generator=g) * 2)
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    w_scale = (torch.rand(N, generator=g) * 0.02 + 1e-3).bfloat16()  # stored bf16 as SGLang does
    return xq, xs, w, w_scale


def test_quant_matmul_per_token_bf16_bits_and_broken_variants():
    xq, xs, w, ws = _qm_inputs()
    out = Q.quant_matmul(xq, w, ws, xs, out_dtype=torch.bfloat16)
    acc = O.int_matmul(xq.numpy(), w.numpy())
    want = O.dequant(acc, _np(ws), _np(xs))
    np.testing.assert_array_equal(_bits(out), want)
    # Broken: dequant in bf16.
    b_bf16 = torch.from_numpy(acc).bfloat16() * ws[None, :] * xs[:, None].bfloat16()
    assert not np.array_equal(_bits(b_bf16), want)
    # Broken: other multiply order acc * (scale * token), caught on fp32 output.
    want32 = O.dequant(acc, _np(ws), _np(xs), out="fp32")
    out32 = Q.quant_matmul(xq, w, ws, xs, out_dtype=torch.float32)
    np.testing.assert_array_equal(out32.numpy().view(np.uint32), want32.view(np.uint32))
    other = torch.from_numpy(acc).float() * (ws.float()[None, :] * xs[:, None])
    assert not np.array_equal(other.numpy().view(np.uint32), want32.view(np.uint32))


def test_quant_matmul_int32_bias_before_dequant_float_bias_after():
    xq, _, w, _ = _qm_inputs(6)
    deq = torch.rand(w.shape[0]) * 1e-4 + 1e-6  # static path: deq_scale fp32, no per-token scale
    ib = torch.randint(-30000, 30000, (w.shape[0],), dtype=torch.int32)
    acc = O.int_matmul(xq.numpy(), w.numpy())
    want = O.dequant(acc, _np(deq), None, ib.numpy())
    np.testing.assert_array_equal(_bits(Q.quant_matmul(xq, w, deq, None, ib)), want)
    # Broken: int32 bias added after dequant.
    after = (torch.from_numpy(acc).float() * deq + ib.float()).bfloat16()
    assert not np.array_equal(_bits(after), want)
    fb = torch.randn(w.shape[0])
    want_f = O.dequant(acc, _np(deq), None, fb.numpy())
    np.testing.assert_array_equal(_bits(Q.quant_matmul(xq, w, deq, None, fb)), want_f)


def test_deq_scale_int64_round_trip_and_fp16_truncation():
    s = torch.tensor([1e-3, 3.7e-5, 0.25, 1.0000001])
    packed = Q.deq_scale_fp32_to_int64(s)
    assert packed.dtype == torch.int64 and torch.all(packed >= 0)
    got = Q.deq_scale_int64_to_fp32(packed)
    want = (s.view(torch.int32) & -8192).view(torch.float32)
    assert torch.equal(got, want)
    assert got[2] == 0.25 and got[3] == 1.0  # truncation toward zero of the mantissa


# ------------------------------------------------------------------------------------------------
# grouped matmul and the MoE chain


def _grouped_inputs(seed=8, E=5, K=96, N=40, counts=(3, 0, 7, 1, 4)):
    g = torch.Generator().manual_seed(seed)
    M = sum(counts) + 2  # two trailing rows outside every group
    xq, xs = Q.dynamic_quant(torch.randn(M, K, generator=g))
    w = torch.randint(-128, 128, (E, N, K), dtype=torch.int8, generator=g)
    sc = torch.rand(E, N, generator=g) * 0.01
    return xq, xs, w, sc, list(counts)


def test_grouped_matmul_equals_per_expert_loop_both_group_list_types():
    xq, xs, w, sc, counts = _grouped_inputs()
    want = O.grouped(xq.numpy(), w.numpy(), _np(sc), _np(xs), counts)
    cum = torch.tensor(np.cumsum(counts))
    a = Q.grouped_quant_matmul(xq, w, sc, xs, cum, 0)
    b = Q.grouped_quant_matmul(xq, w, sc, xs, torch.tensor(counts), 1)
    c = Q.grouped_quant_matmul(xq, w.transpose(1, 2).contiguous(), sc, xs, cum, 0, w_layout="kn")
    np.testing.assert_array_equal(_bits(a), want)
    assert torch.equal(a, b) and torch.equal(a, c)
    assert torch.all(a[sum(counts) :] == 0)


def test_swiglu_clamp_before_silu_and_broken_variant():
    gu = torch.tensor([[12.0, -30.0, 3.0, 0.5, 15.0, -12.0, 2.0, 11.0]])
    L = 10.0
    got = Q.swiglu_clamped(gu, L)
    want = O.swiglu_clamped_f32(gu.numpy(), L, lambda v: F.silu(torch.from_numpy(v)).numpy())
    np.testing.assert_array_equal(got.numpy(), want)
    g, u = gu.chunk(2, -1)
    after = F.silu(g).clamp(max=L) * u.clamp(-L, L)  # SGLang NPUSwigluStepAndMul order
    assert not torch.equal(after, got)
    assert torch.equal(Q.swiglu_clamped(gu, 0.0), F.silu(g) * u)


def _moe_inputs(k, seed=9, T=7, d=64, I=32, E=4):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(T, d, generator=g) * 3).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    w13 = torch.randint(-128, 128, (E, 2 * I, d), dtype=torch.int8, generator=g)
    w2 = torch.randint(-128, 128, (E, d, I), dtype=torch.int8, generator=g)
    s13 = torch.rand(E, 2 * I, generator=g) * 1e-2  # gate/up reach beyond the clamp limit 10
    s2 = torch.rand(E, d, generator=g) * 1e-3
    return x, ids, wts, w13, s13, w2, s2


def _silu32(v):
    return F.silu(torch.from_numpy(np.ascontiguousarray(v))).numpy()


def test_moe_chain_bit_exact_up_to_the_combine():
    """k = 1 and weight 1: the combine adds one exact term, so the whole chain (quant, gmm1, bf16,
    clamped SwiGLU, requant, gmm2) is compared bit for bit."""
    x, ids, _, w13, s13, w2, s2 = _moe_inputs(k=1)
    ones = torch.ones(ids.shape)
    got = Q.moe_w8a8(x, ids, ones, w13, s13, w2, s2, limit=10.0)
    per, _ = O.moe_chain(_np(x), ids.numpy(), _np(ones), w13.numpy(), _np(s13), w2.numpy(), _np(s2), 10.0, _silu32)
    np.testing.assert_array_equal(got.numpy().view(np.uint32), per[:, 0].view(np.uint32))
    xq, xs = Q.dynamic_quant(x)
    h = torch.stack([Q.quant_matmul(xq[t : t + 1], w13[e], s13[e], xs[t : t + 1])[0] for t, e in enumerate(ids[:, 0])])
    assert (h[:, :32] > 10).any() and (h[:, 32:].abs() > 10).any(), "gate and up must cross the limit"
    # Broken: without the clamp, or with the gate clamped after SiLU (and up unclamped), the chain differs.
    assert not torch.equal(Q.moe_w8a8(x, ids, ones, w13, s13, w2, s2, limit=0.0), got)
    clamp_after = lambda v: np.minimum(_silu32(v), np.float32(10.0))  # noqa: E731
    per_after, _ = O.moe_chain(
        _np(x), ids.numpy(), _np(ones), w13.numpy(), _np(s13), w2.numpy(), _np(s2), 0.0, lambda v: clamp_after(v)
    )
    assert not np.array_equal(per_after[:, 0], per[:, 0])


def test_moe_chain_weighted_combine():
    x, ids, wts, w13, s13, w2, s2 = _moe_inputs(k=2)
    got = Q.moe_w8a8(x, ids, wts, w13, s13, w2, s2, limit=10.0).numpy().astype(np.float64)
    per, want = O.moe_chain(_np(x), ids.numpy(), _np(wts), w13.numpy(), _np(s13), w2.numpy(), _np(s2), 10.0, _silu32)
    # fp32 products and sums in some order vs the float64 oracle: |err| <= 2k u sum_j |w_j y_j|, u = 2^-24.
    mag = (np.abs(_np(wts))[:, :, None].astype(np.float64) * np.abs(per)).sum(1)
    assert np.all(np.abs(got - want) <= 2 * 2 * 2.0**-24 * mag)


def test_moe_chain_skips_other_ranks_experts():
    """Under EP, copies routed to another rank's experts arrive as ids outside [0, E): they are sorted
    past the grouped matmuls' groups (no work spent on them) and add nothing, so the result equals
    the oracle over this rank's copies alone. The device leaves rows past the groups unwritten; a
    grouped op that fills them with NaN stands in for that, and a combine that multiplies them by a
    zero weight instead of selecting them away is caught."""
    import dataclasses

    x, ids, wts, w13, s13, w2, s2 = _moe_inputs(k=2, E=4)
    ids = ids.clone()
    ids[::3, 0] = 4  # a later rank's expert
    ids[1::4, 1] = -2  # an earlier rank's expert
    here = (ids >= 0) & (ids < 4)
    assert (~here).sum() >= 3 and here.sum() >= 3
    seen = []

    def unwritten_nan(xq, w, scales, per_token, group_list, group_list_type=0, out_dtype=torch.bfloat16):
        seen.append((xq.shape[0], int(group_list[-1])))
        out = Q.grouped_quant_matmul(xq, w, scales, per_token, group_list, group_list_type, out_dtype)
        out[int(group_list[-1]) :] = float("nan")
        return out

    table = dataclasses.replace(ops.kernels("reference"), grouped_quant_matmul=unwritten_nan)
    got = Q.moe_w8a8(x, ids, wts, w13, s13, w2, s2, limit=10.0, ops=table).numpy().astype(np.float64)
    _, want = O.moe_chain(
        _np(x),
        torch.where(here, ids, 0).numpy(),
        _np(torch.where(here, wts, 0.0)),
        w13.numpy(),
        _np(s13),
        w2.numpy(),
        _np(s2),
        10.0,
        _silu32,
    )
    mag = np.abs(want).max()
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, atol=1e-5 * mag, rtol=0)
    assert seen and all(covered == int(here.sum()) for _, covered in seen), seen  # only this rank's copies

    # Broken: the old combine (other ranks' copies kept, multiplied by weight 0) on unwritten rows.
    def zero_weight_combine(x, topk_ids, topk_weights, *a, **kw):
        E = w13.shape[0]
        rows, order, counts = Q.sort_by_expert(topk_ids, E)
        y = table.grouped_quant_matmul(
            Q.dynamic_quant(x)[0][rows], w13, s13, Q.dynamic_quant(x)[1][rows], torch.cumsum(counts, 0), 0, x.dtype
        )
        w = torch.where((topk_ids >= 0) & (topk_ids < E), topk_weights, 0.0).reshape(-1)[order]
        return torch.zeros(x.shape[0], y.shape[-1]).index_add_(0, rows, y.float() * w[:, None])

    assert not torch.isfinite(zero_weight_combine(x, ids, wts)).all()


# ------------------------------------------------------------------------------------------------
# dispatch


def test_kernels_dispatch_and_force_reference(monkeypatch):
    assert ops.kernels("reference").dynamic_quant is Q.dynamic_quant
    monkeypatch.setenv("SGLANG_DSV4_FORCE_REFERENCE", "1")
    assert ops.kernels().family == "reference"
    with pytest.raises(ValueError, match="unknown kernel family"):
        ops.kernels("tpu")


def test_npu_module_imports_without_torch_npu():
    import importlib.util

    from sglang_dsv4_ascend.ops import npu

    assert "torch_npu" not in sys.modules
    if importlib.util.find_spec("torch_npu") is None:
        with pytest.raises(ImportError):
            npu.dynamic_quant(torch.zeros(1, 4))


# ------------------------------------------------------------------------------------------------
# Triton under the interpreter (TRITON_INTERPRET is read when triton is imported: subprocess)

TRITON_SCRIPT = textwrap.dedent("""
    import sys, torch
    from sglang_dsv4_ascend.ops.triton import quant as T
    sys.path[:0] = [sys.argv[2], sys.argv[3]]
    from test_w8a8_ops import tie_rows, adversarial_rows, _qm_inputs, _grouped_inputs
    out = {}
    g = torch.Generator().manual_seed(11)
    xs = {"ties": tie_rows(), "adv": adversarial_rows(), "bf16": (torch.randn(40, 1500, generator=g) * 4).bfloat16(),
          "fp16": torch.randn(5, 33, generator=g).half(), "fp32": torch.randn(3, 4100, generator=g)}
    for name, x in xs.items():
        out["dq_" + name] = (x, *T.dynamic_quant(x))
    smooth = torch.rand(1500, generator=g) + 0.5
    out["dq_smooth"] = (xs["bf16"], smooth, *T.dynamic_quant(xs["bf16"], smooth))
    xq, x_s, w, ws = _qm_inputs()
    out["qm_tok_bf16"] = T.quant_matmul(xq, w, ws, x_s, out_dtype=torch.bfloat16)
    out["qm_tok_fp32"] = T.quant_matmul(xq, w, ws, x_s, out_dtype=torch.float32)
    deq = torch.rand(w.shape[0], generator=g) * 1e-4
    ib = torch.randint(-30000, 30000, (w.shape[0],), dtype=torch.int32, generator=g)
    out["qm_static"] = (deq, ib, T.quant_matmul(xq, w, deq, None, ib, out_dtype=torch.bfloat16))
    out["qm_kn"] = T.quant_matmul(xq, w.t().contiguous(), ws, x_s, w_layout="kn")
    # The W8A8Linear module on the Triton family (bf16 activations, as served).
    from sglang_dsv4_ascend.quantization.w8a8 import W8A8Linear
    lin = W8A8Linear(w.shape[1], w.shape[0], family="triton")
    lin.weight.copy_(w); lin.weight_scale.copy_(ws.float()); lin.process_weights_after_loading()
    xin = torch.randn(3, 5, w.shape[1], generator=g).bfloat16()
    out["linear"] = (xin, lin(xin))
    torch.save(out, sys.argv[1])
""")


@pytest.fixture(scope="module")
def triton_outputs(tmp_path_factory):
    path = tmp_path_factory.mktemp("triton") / "out.pt"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT, str(path), here, os.path.dirname(here)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return torch.load(path)


def test_triton_dynamic_quant_bit_equal_under_interpreter(triton_outputs):
    for name in ("ties", "adv", "bf16", "fp16", "fp32"):
        x, q, s = triton_outputs["dq_" + name]
        rq, rs = Q.dynamic_quant(x)
        assert torch.equal(q, rq) and torch.equal(s.view(torch.int32), rs.view(torch.int32)), name
        oq, _ = O.dynamic_quant(_np(x))
        np.testing.assert_array_equal(q.numpy().astype(np.int64), oq)
    x, smooth, q, s = triton_outputs["dq_smooth"]
    rq, rs = Q.dynamic_quant(x, smooth)
    assert torch.equal(q, rq) and torch.equal(s, rs)


def test_triton_quant_matmul_bit_equal_under_interpreter(triton_outputs):
    xq, xs, w, ws = _qm_inputs()
    assert torch.equal(
        triton_outputs["qm_tok_bf16"].view(torch.int16),
        Q.quant_matmul(xq, w, ws, xs, out_dtype=torch.bfloat16).view(torch.int16),
    )
    assert torch.equal(
        triton_outputs["qm_tok_fp32"].view(torch.int32),
        Q.quant_matmul(xq, w, ws, xs, out_dtype=torch.float32).view(torch.int32),
    )
    deq, ib, got = triton_outputs["qm_static"]
    assert torch.equal(got.view(torch.int16), Q.quant_matmul(xq, w, deq, None, ib).view(torch.int16))
    assert torch.equal(triton_outputs["qm_kn"], Q.quant_matmul(xq, w, ws, xs))


def test_w8a8_linear_triton_family_equals_reference(triton_outputs):
    from sglang_dsv4_ascend.quantization.w8a8 import W8A8Linear

    _, _, w, ws = _qm_inputs()
    lin = W8A8Linear(w.shape[1], w.shape[0], family="reference")
    lin.weight.copy_(w)
    lin.weight_scale.copy_(ws.float())
    lin.process_weights_after_loading()
    xin, got = triton_outputs["linear"]
    assert got.shape == (3, 5, w.shape[0]) and got.dtype == torch.bfloat16
    assert torch.equal(got, lin(xin))
