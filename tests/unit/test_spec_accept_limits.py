"""The speculative accept step runs in the scheduler for a whole batch: a sampling value the
request guard should have stopped must not raise there (which ends the server with every request
in flight), and valid values must be served exactly as before.

A temperature past float32's range (1e39) reached the worker as inf in SGLang's float32 tensor and
`target_probs` raised on it; each such request is now handled on its own: inf samples at float32's
largest temperature (SGLang's own sampler divides by inf: uniform over the tokens with finite
logits), NaN or negative, which no sampler can use, is served greedy.
"""

import math

import pytest
import torch

from sglang_dsv4_ascend.speculative.accept import (
    FLOAT32_MAX,
    accept_batch,
    greedy_accept,
    sample_accept,
    sampled_temperature,
    target_probs,
)
from sglang_dsv4_ascend.speculative.tree import DraftTree

V = 8


def test_valid_temperatures_are_returned_unchanged():
    for t in (1e-6, 2e-6, 0.3, 0.7, 1.0, 1.6, 1e9, 3.4e38, FLOAT32_MAX):
        got = sampled_temperature({"temperature": t, "top_k": -1})
        assert got == t and type(got) is float
    # SGLang's greedy rules: below 1e-6, top_k 1, or no sampling dict
    for sp in (None, {"temperature": 0.0}, {"temperature": 5e-7}, {"temperature": 0.8, "top_k": 1}):
        assert sampled_temperature(sp) is None


def test_out_of_range_temperatures_do_not_raise():
    inf = float(torch.tensor([1e39], dtype=torch.float32)[0])  # what the worker reads for 1e39
    assert math.isinf(inf)
    assert sampled_temperature({"temperature": inf}) == FLOAT32_MAX
    for bad in (float("nan"), -1.0, float("-inf")):
        assert sampled_temperature({"temperature": bad}) is None


def batch(seed=0):
    g = torch.Generator().manual_seed(seed)
    trees = [DraftTree((3, 1, 4, 1), (-1, 0, 1, 0)) for _ in range(4)]
    logits = [torch.randn(t.n, V, generator=g) * 3 for t in trees]
    logits[1][:, 5] = float("-inf")  # a masked token: inf temperature must not turn it into NaN
    return trees, logits


def test_a_batch_with_out_of_range_temperatures_is_served_per_request():
    trees, logits = batch()
    sampling = [
        {"temperature": 0.8, "top_k": 3, "top_p": 0.9, "min_p": 0.05},
        {"temperature": math.inf},
        {"temperature": math.nan},
        {"temperature": 1.2},
    ]
    got = accept_batch(trees, logits, sampling, torch.Generator().manual_seed(7))

    ref = torch.Generator().manual_seed(7)  # the sampled requests draw from it in batch order
    want = [
        sample_accept(trees[0], target_probs(logits[0], 0.8, 3, 0.9, 0.05), ref),
        sample_accept(trees[1], target_probs(logits[1], FLOAT32_MAX, -1, 1.0, 0.0), ref),
        greedy_accept(trees[2], logits[2].argmax(-1)),
        sample_accept(trees[3], target_probs(logits[3], 1.2, -1, 1.0, 0.0), ref),
    ]
    assert got == want
    # the valid requests' results do not depend on their neighbours' temperatures
    clean = accept_batch([trees[0]], [logits[0]], [sampling[0]], torch.Generator().manual_seed(7))
    assert got[0] == clean[0]


def test_float32_max_temperature_is_the_uniform_limit():
    _, logits = batch()
    p = target_probs(logits[1], FLOAT32_MAX, -1, 1.0, 0.0)
    assert torch.isfinite(p).all()
    assert torch.equal(p[:, 5], torch.zeros(4))  # the -inf token stays impossible
    torch.testing.assert_close(p[:, [0, 1, 2, 3, 4, 6, 7]], torch.full((4, 7), 1 / 7))


def test_target_probs_itself_still_refuses_what_no_sampler_can_use():
    """Direct callers get the error; the batch path above never hands it such a value."""
    for t in (-1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature"):
            target_probs(torch.zeros(2, V), t, -1, 1.0, 0.0)
