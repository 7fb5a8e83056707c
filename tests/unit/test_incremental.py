"""Cached forwards equal one full forward: prefill + decode, chunked prefill, mixed batches, the
speculative write/reject contract, deferred writes, slot reuse.

Every cache here starts poisoned with NaN: a read of any row the contract says is invalid (beyond
the committed length, outside the window, a rejected row) would turn the logits NaN or wrong.
Token seeds come from the near-tie scan in test_model_vs_hf.py (every top-k decision has a margin
far above float noise, so different chunkings cannot flip a selection).
"""

import pytest
import torch

from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.models.weights import load_model_from_dir

TOL = dict(atol=1e-4, rtol=1e-4)
SEEDS = {"flash": [12, 0, 29, 27], "pro": [26, 5, 24]}


def _ids(preset, i=0, n=300):
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(SEEDS[preset][i]))


def _junk(n, seed=99):
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed))


def _cache(model, slots=1, max_len=300, slack=0):
    cache = model.make_cache(slots, max_len, slack)
    for t in cache.state_tensors().values():
        t.fill_(float("nan"))
    return cache


def _run(model, cache, slot, ids, start, pending=None):
    pos = torch.arange(start, start + ids.shape[0])
    return model.compute_logits(model(ids, pos, [Segment(slot, start, ids.shape[0])], cache, pending=pending))


def _full(model, ids):
    return _run(model, model.make_cache(1, ids.shape[0]), 0, ids, 0)


def _chunked(model, cache, slot, ids, sizes, start=0):
    out = []
    for n in sizes:
        out.append(_run(model, cache, slot, ids[start : start + n], start))
        start += n
    return torch.cat(out)


@pytest.mark.parametrize("preset", ["flash", "pro"])
def test_prefill_then_decode_equals_full_forward(preset, dsv4_model):
    """Decode crosses the 256 HCA boundary, 4-blocks and the window, one token at a time."""
    model, ids = dsv4_model(preset), _ids(preset, n=270)
    got = _chunked(model, _cache(model), 0, ids, [250] + [1] * 20)
    torch.testing.assert_close(got, _full(model, ids), **TOL)


@pytest.mark.parametrize(
    "preset,sizes",
    [
        ("flash", [37, 91, 1, 130, 41]),
        ("flash", [5, 123, 172]),
        ("flash", [129, 127, 2, 3, 39]),
        ("flash", [17] * 17 + [11]),
        ("pro", [3, 126, 130, 1, 40]),
    ],
)
def test_chunked_prefill_equals_unchunked(preset, sizes, dsv4_model):
    model, ids = dsv4_model(preset), _ids(preset)
    assert sum(sizes) == 300
    torch.testing.assert_close(_chunked(model, _cache(model), 0, ids, sizes), _full(model, ids), **TOL)


def test_mixed_batch_in_one_forward_equals_each_request_alone(dsv4_model):
    model = dsv4_model("flash")
    seqs = [_ids("flash", i) for i in range(4)]
    full = [_full(model, s) for s in seqs]
    cache = _cache(model, slots=5)
    # history: slot 0 holds 260 tokens of seq 0, slot 3 37 of seq 1, slot 1 253 of seq 3
    for slot, s, n in ((0, 0, 260), (3, 1, 37), (1, 3, 253)):
        _run(model, cache, slot, seqs[s][:n], 0)
    # one forward: chunk 37..136 (crosses 128), new prefill, decode at 260, verify-like 253..257
    plan = [(3, 1, 37, 100), (2, 2, 0, 90), (0, 0, 260, 1), (1, 3, 253, 5)]
    segs = [Segment(slot, start, n) for slot, _, start, n in plan]
    ids = torch.cat([seqs[s][start : start + n] for _, s, start, n in plan])
    pos = torch.cat([torch.arange(start, start + n) for _, _, start, n in plan])
    logits = model.compute_logits(model(ids, pos, segs, cache))
    off = 0
    for _, s, start, n in plan:
        torch.testing.assert_close(logits[off : off + n], full[s][start : start + n], **TOL)
        off += n


def _verify_then_reject(model, slack):
    """Committed L=253; a verify writes 6 rows (253..258, crossing the 256 HCA boundary) and all are
    rejected; then a verify of [true, true, junk x4] at L of which 2 are accepted; then the true
    continuation. Returns (logits of the accepted/committed rows, reference)."""
    ids, L = _ids("flash"), 253
    cache = _cache(model, slack=slack)
    _run(model, cache, 0, ids[:L], 0)
    _run(model, cache, 0, _junk(6), L)  # rejected entirely: committed length stays L
    draft = torch.cat([ids[L : L + 2], _junk(4, seed=7)])
    accepted = _run(model, cache, 0, draft, L)[:2]  # rows L, L+1 accepted -> committed L+2
    after = _run(model, cache, 0, ids[L + 2 : L + 12], L + 2)
    return torch.cat([accepted, after]), _full(model, ids)[L : L + 12]


def test_speculative_rows_beyond_committed_length_are_overwritten(dsv4_model):
    got, ref = _verify_then_reject(dsv4_model("flash"), slack=6)
    torch.testing.assert_close(got, ref, **TOL)


def test_without_spec_slack_rejected_rows_clobber_the_window(dsv4_model):
    """The same sequence on rings without slack must break: the slack is what makes it safe."""
    got, ref = _verify_then_reject(dsv4_model("flash"), slack=0)
    assert (got - ref).abs().max() > 1e-3


def test_deferred_writes_store_only_the_accepted_prefix(dsv4_model):
    model, ids, L = dsv4_model("flash"), _ids("flash"), 253
    ref = _full(model, ids)
    cache = _cache(model, slack=0)  # deferred writes never store rejected rows: no slack needed
    _run(model, cache, 0, ids[:L], 0)
    pending = []
    draft = torch.cat([ids[L : L + 3], _junk(3)])
    got = _run(model, cache, 0, draft, L, pending=pending)[:3]
    assert len(pending) == model.cfg.num_hidden_layers
    cache.apply(pending, accepted={0: 3})
    got = torch.cat([got, _run(model, cache, 0, ids[L + 3 : L + 9], L + 3)])
    torch.testing.assert_close(got, ref[L : L + 9], **TOL)


def test_reset_slot_reuse_equals_fresh_cache(dsv4_model):
    model = dsv4_model("flash")
    a, b, c = (_ids("flash", i) for i in range(3))
    cache = _cache(model, slots=2)
    _chunked(model, cache, 0, a, [300])
    _chunked(model, cache, 1, b, [150])
    other = cache.slot_state(1)
    cache.reset_slot(0)
    after0, after1 = cache.slot_state(0), cache.slot_state(1)
    assert after0.keys() == other.keys()
    for k in other:
        assert not after0[k].any(), k
        assert torch.equal(after1[k], other[k]) or torch.isnan(other[k]).any(), k  # slot 1 untouched
    torch.testing.assert_close(_chunked(model, cache, 0, c, [100, 1, 199]), _full(model, c), **TOL)
    torch.testing.assert_close(_chunked(model, cache, 1, b, [1, 1], start=150), _full(model, b)[150:152], **TOL)


def test_bf16_model_runs_and_tracks_fp32(tiny_ckpt, dsv4_model):
    model = load_model_from_dir(tiny_ckpt("flash"), dtype=torch.bfloat16)
    assert model.layers[2].attn.wq_a.weight.dtype == torch.bfloat16
    assert model.layers[2].hc_attn_fn.dtype == torch.float32 and model.layers[2].attn.attn_sink.dtype == torch.float32
    ids = _ids("flash", n=140)
    cache = model.make_cache(1, 140)
    assert cache.layers[2].swa.dtype == torch.bfloat16
    got = _chunked(model, cache, 0, ids, [130] + [1] * 10)
    ref = _full(dsv4_model("flash"), ids)
    assert torch.isfinite(got).all()
    # bf16 weights and activations: loose agreement, and the same greedy token almost everywhere
    assert (got - ref).abs().max() < 0.25 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_cache_byte_accounting(dsv4_model):
    cfg = dsv4_model("flash").cfg  # ratios 0, 0, 4, 128, 4; D 64, Di 32, window 16
    cache = dsv4_model("flash").make_cache(2, 256, spec_slack=3)
    nb, D, Di, f32 = cache.nbytes(), cfg.head_dim, cfg.index_head_dim, 4
    # Rings: 2 slots + 1 scratch slot (padding rows of static plans write there).
    assert nb["swa"] == 5 * 3 * (16 + 3) * D * f32
    # Entries are sized per token slot: 2 slots x 259 positions, each slot padded to 384 (3 x 128),
    # plus one scratch row per store.
    assert cache.num_token_slots == 2 * 384
    assert nb["c4_kv"] == 2 * (768 // 4 + 1) * D * f32 and nb["c4_index"] == 2 * (768 // 4 + 1) * Di * f32
    assert nb["c128_kv"] == (768 // 128 + 1) * D * f32
    rows = 3 * 2 * ((8 + 3) * 2 * D + (8 + 3) * 2 * Di) + 3 * (128 + 3) * D  # kv+gate rows, fp32
    assert nb["compressor_rows"] == rows * 2 * f32
    assert nb["total"] == sum(v for k, v in nb.items() if k != "total")
    assert cache.bytes_per_token() == nb["total"] / 768
