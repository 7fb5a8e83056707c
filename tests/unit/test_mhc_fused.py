"""The compiled mHC coefficients (ops/scripted.py) equal the Python-loop reference on random and
extreme inputs, and the comparison is sharp enough to catch a Sinkhorn one iteration short."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_dsv4_ascend.ops import reference as R
from sglang_dsv4_ascend.ops import scripted as S

TOL = dict(atol=1e-6, rtol=1e-5)  # fp32; in practice the results are bit-identical


def _logits(T, n, scale, seed):
    return torch.randn(T, n, n, generator=torch.Generator().manual_seed(seed)) * scale


@settings(max_examples=60, deadline=None)
@given(
    T=st.integers(1, 40),
    n=st.sampled_from([1, 2, 4, 8]),
    scale=st.sampled_from([1e-3, 1.0, 30.0, 1e3, 1e5]),
    iters=st.integers(1, 25),
    seed=st.integers(0, 2**31 - 1),
)
def test_scripted_sinkhorn_equals_the_loop(T, n, scale, iters, seed):
    x = _logits(T, n, scale, seed)
    torch.testing.assert_close(S.sinkhorn(x, iters, 1e-6), R.sinkhorn(x, iters, 1e-6), **TOL)


def test_extreme_logits():
    x = torch.tensor(
        [[[80.0, -80.0, 0.0, 1e4], [-1e4, 3.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0], [float("-inf"), 0.0, 1.0, 2.0]]]
    )
    got, want = S.sinkhorn(x, 20, 1e-6), R.sinkhorn(x, 20, 1e-6)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, **TOL)


def test_a_sinkhorn_one_iteration_short_is_caught():
    """Broken variant: the same loop with iters-1. Skewed logits converge slowly, so the short
    variant differs from the reference far beyond the tolerance used above."""
    x = _logits(16, 4, 30.0, 7)
    short = R.sinkhorn(x, 19, 1e-6)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(short, R.sinkhorn(x, 20, 1e-6), **TOL)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(short, S.sinkhorn(x, 20, 1e-6), **TOL)


@pytest.mark.parametrize("T,d", [(1, 64), (5, 64), (3, 512)])
def test_scripted_mhc_weights_equal_the_reference(T, d):
    g = torch.Generator().manual_seed(T * d)
    streams = torch.randn(T, 4, d, generator=g)
    fn, base, scale = (
        torch.randn(24, 4 * d, generator=g) * 0.2,
        torch.randn(24, generator=g),
        torch.rand(3, generator=g),
    )
    args = (streams, fn, base, scale, 4, 20, 1e-6, 1e-6)
    for got, want in zip(S.mhc_weights(*args), R.mhc_weights(*args)):
        torch.testing.assert_close(got, want, **TOL)


def test_a_capture_records_the_mhc_coefficients_as_one_op():
    """Inside torch.compile the coefficients are the opaque op `dsv4_ascend.mhc_weights` (its
    replay runs the compiled function above), not the ~130 traced ops of the Sinkhorn loop: the
    captured sublayer holds one op where the loop held dozens of divisions, and equals eager."""
    g = torch.Generator().manual_seed(3)
    streams = torch.randn(5, 4, 64, generator=g)
    fn, base, scale = torch.randn(24, 256, generator=g) * 0.2, torch.randn(24, generator=g), torch.rand(3, generator=g)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def coefficients(s):
        return S.mhc_weights(s, fn, base, scale, 4, 20, 1e-6, 1e-6)

    torch._dynamo.reset()
    got = torch.compile(coefficients, backend=record, dynamic=False)(streams)
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert targets.count("dsv4_ascend.mhc_weights.default") == 1, targets
    assert sum("truediv" in t or "div" in t for t in targets) == 0, targets  # no Sinkhorn step traced
    for a, b in zip(got, R.mhc_weights(streams, fn, base, scale, 4, 20, 1e-6, 1e-6)):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    # the loop the op replaces, traced op by op (the reference itself): dozens of divisions
    graphs.clear()
    torch._dynamo.reset()
    torch.compile(lambda s: R.mhc_weights(s, fn, base, scale, 4, 20, 1e-6, 1e-6), backend=record)(streams)
    traced = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("truediv" in t for t in traced) >= 38, traced
