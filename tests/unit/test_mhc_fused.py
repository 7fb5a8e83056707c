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
