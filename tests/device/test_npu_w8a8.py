"""ops/npu.py (torch_npu) against the plain-torch reference (ops/quant.py), on an Ascend NPU.

Skipped where torch_npu is not installed; torch_npu is imported inside the tests only (importing it
without CANN breaks `import torch`). NEVER RUN BY THIS PROJECT: no NPU was available, so every
expectation below is what the reference says the device does (dsv4_reference.md §4.4), not an
observation. What each comparison expects:
* dynamic quant, static quant, int8 matmul + dequant (per-token and static with int32 bias),
  grouped matmul: bit-exact (the documented golden references are exactly these formulas);
* all-zero rows in npu_dynamic_quant: reported, not asserted (0/0 behaviour is unverified);
* the MoE chain: bit-exact up to the combine; the combine within fp32 summation-order tolerance.
"""

import importlib.util

import pytest
import torch

from sglang_dsv4_ascend import ops
from sglang_dsv4_ascend.ops import quant as Q

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(
        importlib.util.find_spec("torch_npu") is None, reason="torch_npu not installed (needs CANN + NPU)"
    ),
]


@pytest.fixture(scope="module")
def npu():
    import torch_npu  # noqa: F401  (registers the npu device)

    if not torch.npu.is_available():
        pytest.skip("torch_npu installed but no NPU visible")
    from sglang_dsv4_ascend.ops import npu as N

    return N


def _dev(t):
    return t.to("npu")


def test_dynamic_quant_bit_exact(npu):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4096, generator=g) * 3).bfloat16()
    x[:, 0] = 127.0  # many exact .5 ties after scaling (scale 1.0)
    x[3, 1:] = torch.arange(-63, 63.5, 1.0).repeat(33)[:4095] + 0.5
    q, s = npu.dynamic_quant(_dev(x))
    rq, rs = Q.dynamic_quant(x)
    assert torch.equal(s.cpu(), rs)
    assert torch.equal(q.cpu(), rq)


def test_dynamic_quant_zero_row_reported(npu):
    x = torch.zeros(2, 256, dtype=torch.bfloat16)
    x[1, 3] = 1.0
    q, s = npu.dynamic_quant(_dev(x))
    print(f"\nnpu_dynamic_quant on an all-zero row: scale {s[0].item()}, q unique {q[0].unique().tolist()}")
    assert torch.equal(q[1].cpu(), Q.dynamic_quant(x)[0][1])


def test_static_quant_bit_exact(npu):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(32, 1024, generator=g) * 4).bfloat16()
    for scale, offset in [(0.0173, -7.0), (0.03, 0.0)]:
        s, o = torch.tensor([scale]), torch.tensor([offset])
        got = npu.static_quant(_dev(x), _dev(s), _dev(o), torch.bfloat16)
        assert torch.equal(got.cpu(), Q.static_quant(x, s, o, torch.bfloat16))


@pytest.mark.parametrize("M,K,N", [(1, 4096, 1024), (16, 1024, 4096), (128, 4096, 512)])
def test_quant_matmul_per_token_bit_exact(npu, M, K, N):
    g = torch.Generator().manual_seed(M + K)
    xq, xs = Q.dynamic_quant(torch.randn(M, K, generator=g))
    w = torch.randint(-128, 128, (N, K), dtype=torch.int8, generator=g)
    ws = (torch.rand(N, generator=g) * 0.01).bfloat16()
    got = npu.quant_matmul(_dev(xq), npu.prepare_weight(_dev(w)), _dev(ws), _dev(xs), None, torch.bfloat16)
    assert torch.equal(got.cpu(), Q.quant_matmul(xq, w, ws, xs, out_dtype=torch.bfloat16))


def test_quant_matmul_static_int32_bias_bit_exact(npu):
    g = torch.Generator().manual_seed(3)
    xq = torch.randint(-128, 128, (8, 2048), dtype=torch.int8, generator=g)
    w = torch.randint(-128, 128, (256, 2048), dtype=torch.int8, generator=g)
    deq = torch.rand(256, generator=g) * 1e-5
    qb = torch.randint(-100000, 100000, (256,), dtype=torch.int32, generator=g)
    got = npu.quant_matmul(_dev(xq), npu.prepare_weight(_dev(w)), _dev(deq), None, _dev(qb), torch.bfloat16)
    assert torch.equal(got.cpu(), Q.quant_matmul(xq, w, deq, None, qb, torch.bfloat16))


def test_grouped_matmul_bit_exact(npu):
    g = torch.Generator().manual_seed(4)
    E, K, N, counts = 4, 512, 256, [5, 0, 9, 2]
    xq, xs = Q.dynamic_quant(torch.randn(sum(counts), K, generator=g))
    w = torch.randint(-128, 128, (E, N, K), dtype=torch.int8, generator=g)
    sc = torch.rand(E, N, generator=g) * 0.01
    cum = torch.cumsum(torch.tensor(counts), 0)
    got = npu.grouped_quant_matmul(
        _dev(xq), npu.prepare_weight(_dev(w)), _dev(sc), _dev(xs), _dev(cum), 0, torch.bfloat16
    )
    assert torch.equal(got.cpu(), Q.grouped_quant_matmul(xq, w, sc, xs, cum, 0, torch.bfloat16))


def test_moe_chain_npu_family(npu):
    g = torch.Generator().manual_seed(5)
    T, d, I, E, k = 16, 512, 256, 8, 2
    x = (torch.randn(T, d, generator=g) * 3).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    wts = torch.rand(T, k, generator=g)
    w13 = torch.randint(-128, 128, (E, 2 * I, d), dtype=torch.int8, generator=g)
    w2 = torch.randint(-128, 128, (E, d, I), dtype=torch.int8, generator=g)
    s13, s2 = torch.rand(E, 2 * I, generator=g) * 1e-2, torch.rand(E, d, generator=g) * 1e-3
    ref = Q.moe_w8a8(x, ids, wts, w13, s13, w2, s2, 10.0)
    fam = ops.kernels("npu")
    got = Q.moe_w8a8(
        _dev(x),
        _dev(ids),
        _dev(wts),
        fam.prepare_weight(_dev(w13)),
        _dev(s13),
        fam.prepare_weight(_dev(w2)),
        _dev(s2),
        10.0,
        ops=fam,
    )
    torch.testing.assert_close(got.cpu(), ref, rtol=1e-6, atol=1e-6 * ref.abs().max().item())
