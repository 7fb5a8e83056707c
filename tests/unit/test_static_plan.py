"""Static-shape plans (plan.Bucket), the precondition for graph capture: a decode or verify forward
padded to a bucket issues the same aten ops on the same shapes every step, whatever the contexts
and however many requests fill the bucket, and gives the unpadded forward's logits and cache state.

The op trace (every aten op the layers run, with the shapes and dtypes of its tensor arguments) is
what a CUDA / ACL graph records once and replays; two steps with equal traces replay one graph. A
broken variant (padding rows written into a live request's ring instead of the scratch slot) must be
caught by the state comparison."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.kvcache.cache import DSV4Cache
from sglang_dsv4_ascend.kvcache.plan import Bucket, build_plan

TOL = dict(atol=2e-5, rtol=2e-5)


class _Trace(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        def sig(x):
            if isinstance(x, torch.Tensor):
                return (tuple(x.shape), x.dtype)
            if isinstance(x, (list, tuple)):
                return tuple(sig(y) for y in x)
            return None

        self.ops.append((str(func), sig(args)))
        return func(*args, **(kwargs or {}))


def _committed_cache(model, contexts):
    cache = model.make_cache(len(contexts), 700, spec_slack=8)
    g = torch.Generator().manual_seed(0)
    for s, L in enumerate(contexts):
        model(torch.randint(0, 1000, (L,), generator=g), torch.arange(L), [Segment(s, 0, L)], cache)
    return cache


def _forward(model, cache, segs, bucket=None, trace=False):
    """Logits of the real rows, the layers' op trace if asked; writes stored in the layers."""
    n = sum(s.length for s in segs)
    ids = (torch.arange(n) * 37 + 11) % 1000
    pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in segs])
    plan = build_plan(segs, cache, bucket=bucket)
    if bucket is not None:  # padding rows: any id, any position
        ids = torch.cat([ids, torch.zeros(bucket.rows - n, dtype=torch.long)])
        pos = torch.cat([pos, torch.zeros(bucket.rows - n, dtype=torch.long)])
    mode = _Trace()
    handles = []
    if trace:
        handles = [
            model.layers[0].register_forward_pre_hook(lambda *_: mode.__enter__() and None),
            model.layers[-1].register_forward_hook(lambda *_: mode.__exit__(None, None, None)),
        ]
    try:
        logits = model.compute_logits(model(ids, pos, segs, cache, plan=plan))[:n]
    finally:
        for h in handles:
            h.remove()
    return logits, mode.ops


def _live_state(cache, slots):
    return {s: cache.slot_state(s) for s in slots}


def _decode_steps(model, contexts, bucket, schedule):
    """Decode steps of the slots in each entry of `schedule`, padded to `bucket` on one cache and
    unpadded on a twin: the logits equal at every step and every request's state equal at the
    end -> (the padded steps' op traces, the padded cache). `contexts` advances as steps commit."""
    padded, plain = _committed_cache(model, contexts), _committed_cache(model, contexts)
    traces = []
    for slots in schedule:
        segs = [Segment(s, contexts[s], 1) for s in slots]
        a, ops = _forward(model, padded, segs, bucket, trace=True)
        b, _ = _forward(model, plain, segs)
        torch.testing.assert_close(a, b, **TOL)
        traces.append(ops)
        for s in slots:
            contexts[s] += 1
    for s, state in _live_state(padded, range(len(contexts))).items():
        for k, v in state.items():
            torch.testing.assert_close(v, plain.slot_state(s)[k], **TOL, msg=f"slot {s} {k}")
    return traces, padded


def test_decode_bucket_replays_one_trace_and_equals_unpadded(dsv4_model):
    model = dsv4_model("pro")  # SWA, CSA (indexer) and HCA layers
    # Steps with 1, 3 and 4 requests at different contexts, crossing C4 and C128 boundaries.
    traces, _ = _decode_steps(
        model, [300, 129, 7, 511], Bucket(rows=8, seg_tokens=1), ([0], [0, 1, 2], [3, 1, 2, 0], [2])
    )
    assert len(traces[0]) > 100 and all(t == traces[0] for t in traces[1:])
    # Without a bucket the shapes follow the batch: the traces differ (the test is sensitive).
    c = _committed_cache(model, [300, 129])
    _, t1 = _forward(model, c, [Segment(0, 300, 1)], trace=True)
    _, t2 = _forward(model, c, [Segment(0, 301, 1), Segment(1, 129, 1)], trace=True)
    assert t1 != t2


def test_verify_bucket_equals_unpadded(dsv4_model):
    model = dsv4_model("flash")
    contexts = [200, 131]
    bucket = Bucket(rows=8, seg_tokens=4)
    padded, plain = _committed_cache(model, contexts), _committed_cache(model, contexts)
    _, t1 = _forward(model, padded, [Segment(0, 200, 4)], bucket, trace=True)
    _forward(model, plain, [Segment(0, 200, 4)])
    segs = [Segment(0, 204, 4), Segment(1, 131, 3)]
    a, t2 = _forward(model, padded, segs, bucket, trace=True)
    b, _ = _forward(model, plain, segs)
    torch.testing.assert_close(a, b, **TOL)
    assert t1 == t2


def test_padding_rows_written_into_a_live_ring_are_caught(dsv4_model, monkeypatch):
    """Broken variant: the scratch slot replaced by request 0's own slot. Padding rows then
    overwrite ring rows of a live request, which the next steps read."""
    model = dsv4_model("flash")
    contexts = [200, 131]
    bucket = Bucket(rows=8, seg_tokens=1)
    padded, plain = _committed_cache(model, contexts), _committed_cache(model, contexts)
    monkeypatch.setattr(padded, "pad_slot", 0)
    diffs = []
    for step in range(3):
        segs = [Segment(0, contexts[0] + step, 1)]
        a, _ = _forward(model, padded, segs, bucket)
        b, _ = _forward(model, plain, segs)
        diffs.append((a - b).abs().max().item())
    state_diff = max((v - plain.slot_state(0)[k]).abs().max().item() for k, v in padded.slot_state(0).items())
    assert state_diff > 1e-3 and max(diffs[1:]) > 1e-4  # stored wrongly, then read back


def test_bucket_refuses_what_it_cannot_hold(dsv4_model):
    model = dsv4_model("flash")
    cache = model.make_cache(3, 300, spec_slack=4)
    with pytest.raises(ValueError, match="has 3 rows"):
        build_plan([Segment(0, 10, 1), Segment(1, 10, 1), Segment(2, 3, 1)], cache, bucket=Bucket(2, 1))
    with pytest.raises(ValueError, match="up to 5 per request"):
        build_plan([Segment(0, 10, 5)], cache, bucket=Bucket(8, 4))
    with pytest.raises(ValueError, match="smallest ring"):
        build_plan([Segment(0, 10, 1)], cache, bucket=Bucket(64, 64))


def test_a_context_bucket_is_as_wide_as_its_context_and_equals_unpadded(dsv4_model):
    """A bucket bounded at 512 committed tokens on a 708-token cache: its committed tables (C4
    entries and indexer keys, C128 entries) are 512 // r wide, not the cache's 708 // r (what a
    static step pays for, kvcache/plan.py), and a step with a request exactly at the bound (its
    last committed entry in the table's last column) still equals the unpadded forward, logits and
    state. One past the bound is refused; SGLANG_DSV4_GRAPH_CONTEXT at or above the capacity, or
    a cache without compressed layers, means the whole cache."""
    from sglang_dsv4_ascend.kvcache.plan import fits, graph_context

    model = dsv4_model("pro")  # SWA, CSA (indexer) and HCA layers
    contexts = [300, 129, 7, 510]
    bucket = Bucket(rows=8, seg_tokens=1, context=512)
    # slot 3 at 510, 511, 512 committed tokens
    traces, padded = _decode_steps(model, contexts, bucket, ([3], [0, 1, 3], [3, 2]))
    assert padded.capacity == 708 and all(t == traces[0] for t in traces[1:])
    for segs in ([(3, 510)], [(0, 300), (1, 129), (3, 511)], [(3, 512), (2, 7)]):  # each step's plan
        plan = build_plan([Segment(s, L, 1) for s, L in segs], padded, bucket=bucket)
        assert {r: (rp.max_committed, rp.slot_entries.shape[1]) for r, rp in plan.ratios.items() if r} == {
            4: (128, 128),
            128: (4, 4),
        }
    whole = build_plan([Segment(0, 300, 1)], padded, bucket=Bucket(8, 1))
    assert whole.ratios[4].max_committed == 708 // 4
    assert contexts[3] == 513 and not fits([513], 512) and fits([513], None)
    with pytest.raises(ValueError, match="513 committed tokens"):
        build_plan([Segment(3, 513, 1)], padded, bucket=bucket)
    assert graph_context(padded, 512) == 512 and graph_context(padded, 708) is None
    swa_only = DSV4Cache(model.cfg, 1, 4096, 8, ratios=(0, 0))  # a NextN draft's cache
    assert graph_context(swa_only, 512) is None
