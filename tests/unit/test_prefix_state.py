"""Prefix states (kvcache/prefix_state.py): a request that resumes a prefix another
request computed, through shared token slots plus the state saved at the boundary, gives the
logits and the cache state of computing the whole prompt itself (the cold oracle), for both the
batched forward and the per-segment definition; restoring the window but not the open
compressor rows, or a state saved at another boundary, is caught."""

import pytest
import torch

from sglang_dsv4_ascend import settings
from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.kvcache import prefix_state
from sglang_dsv4_ascend.kvcache.cache import DSV4Cache

PAGE = 128


def _tables(length, share):
    """Slot 0 (the earlier request) and slot 1 (the resuming one) own distinct pages, except that
    slot 1's first `share` positions map to slot 0's slots (a radix hit: SGLang writes the tree's
    slots into the new request's row)."""
    pages = -(-length // PAGE)
    table = torch.zeros(3, pages * PAGE, dtype=torch.int32)
    for s in range(3):
        table[s] = torch.arange(s * pages * PAGE, (s + 1) * pages * PAGE, dtype=torch.int32)
    table[1, :share] = table[0, :share]
    return table, 3 * pages * PAGE


def _forward(model, cache, ids, slot, start, chunks):
    """Logits of ids[start:] fed to `slot` in chunks of the given sizes."""
    out, p = [], start
    for n in chunks:
        x = ids[p : p + n]
        out.append(model.compute_logits(model(x, torch.arange(p, p + n), [Segment(slot, p, n)], cache)))
        p += n
    return torch.cat(out)


def _prompts(length, share, seed=5):
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(0, 1024, (length,), generator=g)
    b = torch.cat([a[:share], torch.randint(0, 1024, (length - share,), generator=g)])
    return a, b


@pytest.mark.parametrize("impl", ["batched", "segments"])
@pytest.mark.parametrize(
    "preset,share,chunks_a",
    [
        ("flash", 256, [300]),  # two boundaries deep inside one prefill chunk
        ("pro", 128, [100, 40, 160]),  # a boundary completed by the middle chunk
        ("flash", 384, [380, 1, 1, 1, 1, 1, 1]),  # the last boundary completed by a decode step
    ],
)
def test_resumed_prefix_equals_cold(dsv4_model, monkeypatch, impl, preset, share, chunks_a):
    model = dsv4_model(preset)
    monkeypatch.setattr(model, "attention_impl", impl)
    L = sum(chunks_a)
    a, b = _prompts(L, share)
    table, n_tok = _tables(L, share)
    table, n_tok = _tables(L + 1, share)
    cache = DSV4Cache(model.cfg, 2, L + 1, token_slots=table, num_token_slots=n_tok)
    store = cache.enable_prefix_states(capacity=8)
    _forward(model, cache, a, 0, 0, chunks_a)
    assert store.usable_prefix(table[1].tolist(), share) == share

    cache.restore_prefix(1, share)
    got = _forward(model, cache, b, 1, share, [L - share])
    cold_cache = model.make_cache(1, L + 1)
    cold = _forward(model, cold_cache, b, 0, 0, [L])[share:]
    torch.testing.assert_close(got, cold, atol=1e-4, rtol=1e-4)
    # and the next decode step reads the same state a cold request would have
    nxt = torch.tensor([7])
    d_got = model.compute_logits(model(nxt, torch.tensor([L]), [Segment(1, L, 1)], cache))
    d_cold = model.compute_logits(model(nxt, torch.tensor([L]), [Segment(0, L, 1)], cold_cache))
    torch.testing.assert_close(d_got, d_cold, atol=1e-4, rtol=1e-4)


def test_window_without_compressor_rows_is_caught(dsv4_model, monkeypatch):
    """Broken variant: restore the SWA rows only (the C4 compressor rows of the block before the
    boundary stay whatever the slot held). The first entry completed after the hit pools wrong
    rows, so the logits move."""
    model = dsv4_model("flash")
    L, share = 300, 256
    a, b = _prompts(L, share)
    table, n_tok = _tables(L, share)
    cache = DSV4Cache(model.cfg, 2, L, token_slots=table, num_token_slots=n_tok)
    cache.enable_prefix_states(capacity=8)
    _forward(model, cache, a, 0, 0, [L])
    rows = cache.prefix.rows
    monkeypatch.setattr(cache.prefix, "rows", [{} for _ in rows])  # restore reads no compressor rows
    cache.restore_prefix(1, share)
    monkeypatch.setattr(cache.prefix, "rows", rows)
    got = _forward(model, cache, b, 1, share, [L - share])
    cold = _forward(model, model.make_cache(1, L), b, 0, 0, [L])[share:]
    assert (got - cold).abs().max() > 1e-3


def test_state_from_another_boundary_is_caught(dsv4_model):
    """Broken variant: resume at 256 from the state saved at 128 (a lookup that ignored the
    boundary). The window then holds the wrong positions and the logits move; the real lookup
    refuses it."""
    model = dsv4_model("flash")
    L, share = 300, 256
    a, b = _prompts(L, share)
    table, n_tok = _tables(L, share)
    cache = DSV4Cache(model.cfg, 2, L, token_slots=table, num_token_slots=n_tok)
    store = cache.enable_prefix_states(capacity=8)
    _forward(model, cache, a, 0, 0, [L])
    assert store.lookup(int(table[1, 127]), 256) is None  # saved for 128, not 256
    idx = store.lookup(int(table[1, 127]), 128)
    store._by_key[int(table[1, 255])] = idx  # point 256's key at 128's state
    store._boundary[idx] = 256
    cache.restore_prefix(1, share)
    got = _forward(model, cache, b, 1, share, [L - share])
    cold = _forward(model, model.make_cache(1, L), b, 0, 0, [L])[share:]
    assert (got - cold).abs().max() > 1e-3


def test_store_is_lru_and_refuses_a_missing_state(dsv4_model):
    model = dsv4_model("flash")
    L = 640  # five boundaries in one prefill, three states: the two shallowest are dropped
    a, _ = _prompts(L, 0)
    table, n_tok = _tables(L, 0)
    cache = DSV4Cache(model.cfg, 2, L, token_slots=table, num_token_slots=n_tok)
    store = cache.enable_prefix_states(capacity=3)
    _forward(model, cache, a, 0, 0, [L])
    slots = table[0].tolist()
    assert [store.lookup(slots[b - 1], b) is not None for b in (128, 256, 384, 512, 640)] == [
        False,
        False,
        True,
        True,
        True,
    ]
    assert store.usable_prefix(slots, 600) == 512  # deepest boundary <= 600 with a state
    # a new state evicts the least recently used one: 384 (512 was just used)
    store.reserve([10_000], [128])
    assert store.lookup(slots[383], 384) is None and store.lookup(slots[511], 512) is not None
    with pytest.raises(RuntimeError, match="no prefix state is saved"):
        cache.restore_prefix(1, 384)


def test_rejected_verify_rows_save_no_state(dsv4_model):
    """A deferred (speculative) forward saves a boundary's state only if the accepted rows reach
    it, and a whole-forward variant that was never stored claims no state."""
    model = dsv4_model("flash")
    L = 130
    a, _ = _prompts(L, 0)
    table, n_tok = _tables(L, 0)
    cache = DSV4Cache(model.cfg, 2, L, token_slots=table, num_token_slots=n_tok)
    store = cache.enable_prefix_states(capacity=4)
    _forward(model, cache, a, 0, 0, [126])
    pending = []
    model(a[126:130], torch.arange(126, 130), [Segment(0, 126, 4)], cache, pending=pending)
    cache.apply(pending, accepted={0: 1})  # committed 127: boundary 128 not reached
    assert store.lookup(int(table[0, 127]), 128) is None
    pending = []
    model(a[127:130], torch.arange(127, 130), [Segment(0, 127, 3)], cache, pending=pending)
    cache.apply(pending, accepted={0: 2})  # committed 129: boundary 128 reached
    assert store.lookup(int(table[0, 127]), 128) is not None


def test_state_memory_matches_the_docstring_arithmetic():
    """The per-state bytes the module docstring gives for the released configs, from the store's
    real allocations (meta device, bf16)."""
    from sglang_dsv4_ascend.bench.cache import CONFIGS
    from sglang_dsv4_ascend.config import DSV4Config

    for name, mb in (("flash", 6.50), ("pro", 9.22)):
        cache = DSV4Cache(DSV4Config.from_hf(CONFIGS[name]), 1, 1024, dtype=torch.bfloat16, device="meta")
        per_state = prefix_state.PrefixStates(cache, 1, PAGE).nbytes()
        assert abs(per_state / 1e6 - mb) < 0.01, (name, per_state)
        assert f"{mb:.2f} MB per state" in prefix_state.__doc__


def test_env_capacity_is_checked(monkeypatch):
    monkeypatch.setenv(settings.PREFIX_STATES.name, "many")
    with pytest.raises(ValueError, match="SGLANG_DSV4_PREFIX_STATES"):
        prefix_state.PrefixStates.default_capacity(4096, PAGE)
    monkeypatch.setenv(settings.PREFIX_STATES.name, "5")
    assert prefix_state.PrefixStates.default_capacity(4096, PAGE) == 5


def test_bench_prefix_memory_arithmetic():
    """`bench prefix`'s memory rows: a cached token costs its entries plus its share of the state
    store at the default density (one state per 16 pages), from the real allocations."""
    from sglang_dsv4_ascend.bench.prefix import memory

    for name in ("flash", "pro"):
        m = memory(name)
        assert m["cached_bytes_per_token"] == pytest.approx(
            m["entry_bytes_per_token"] + m["state_bytes"] / (16 * PAGE), abs=0.2
        )
        # reusing 90 % of a 128K request keeps less than serving it without the cache would need
        assert m["request_128k_90pct_hit_reused_bytes"] < m["request_128k_bytes_without_prefix_cache"]
    assert memory("flash")["entry_bytes_per_token"] == pytest.approx(6880, abs=1)


def _spec_engine(tmp_path, kind, cache):
    import types

    from sglang_dsv4_ascend.models.dspark import load_dspark_from_dir
    from sglang_dsv4_ascend.models.nextn import load_nextn_from_dir
    from sglang_dsv4_ascend.models.weights import load_model_from_dir
    from sglang_dsv4_ascend.speculative.drafters import make_drafter
    from sglang_dsv4_ascend.speculative.engine import NextNEngine, SpecEngine
    from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint

    ckpt = write_checkpoint(str(tmp_path / kind), "flash", kind)
    trunk = load_model_from_dir(ckpt)
    gen = torch.Generator().manual_seed(0)
    if kind == "nextn":
        model = types.SimpleNamespace(model=trunk, nextn=load_nextn_from_dir(ckpt, trunk.cfg), cfg=trunk.cfg)
        return trunk, lambda c: NextNEngine(model, c, 1, 2, 3, make_drafter, gen)
    model = types.SimpleNamespace(model=trunk, dspark=load_dspark_from_dir(ckpt, trunk.cfg), cfg=trunk.cfg)
    return trunk, lambda c: SpecEngine(model, c, make_drafter, gen, gamma=3, topk=1, num_steps=3, num_draft_tokens=4)


def _prefill(trunk, eng, cache, ids, slot, start, nxt):
    """Target forward of ids[start:] then the draft extend over it (the worker's prefill)."""
    n = len(ids) - start
    seg = [Segment(slot, start, n)]
    aux = {"layer_ids": getattr(eng.drafter, "layer_ids", ())}
    trunk(torch.tensor(ids[start:]), torch.arange(start, len(ids)), seg, cache, aux=aux)
    eng.extend(seg, torch.tensor(ids[start + 1 :] + [nxt]), aux, None, [(0, n - 1)])


def _draft_view(eng, slot, L, bonus):
    """What the drafter proposes from this slot: NextN's root logits, DSpark's block logits."""
    d = eng.drafter
    if hasattr(d, "root_logits"):
        return d.root_logits[slot].clone()
    trunk = eng.model.model
    U, _ = d.net.block(d.ctx, [slot], [L], torch.tensor([bonus]), eng.gamma, trunk.embed, trunk.compute_logits)
    return U[0]


@pytest.mark.parametrize("kind", ["nextn", "dspark"])
@pytest.mark.parametrize("restore_draft", [True, False])
def test_draft_state_resumes_with_the_prefix(tmp_path, kind, restore_draft):
    """A speculative engine whose cache has prefix states: the request that resumes a prefix
    drafts exactly what a cold request over the same tokens drafts (NextN's root logits read the
    restored window rows; DSpark's block reads every stage's restored context). Skipping the
    draft's restore (target restored only) is caught. For NextN the resumed request also shares
    token L, as SGLang's EAGLE tree (bigram keys) guarantees: the draft row L - 1 reads it."""
    L, share, new = 300, 256, 5
    a = torch.randint(0, 1024, (L,), generator=torch.Generator().manual_seed(3)).tolist()
    same = share + 1 if kind == "nextn" else share
    b = a[:same] + torch.randint(0, 1024, (share + new - same,), generator=torch.Generator().manual_seed(4)).tolist()
    table, n_tok = _tables(L + 8, share)
    trunk, make = _spec_engine(tmp_path, kind, None)
    cache = DSV4Cache(trunk.cfg, 3, L + 8, spec_slack=4, token_slots=table, num_token_slots=n_tok)
    cache.enable_prefix_states(capacity=8)
    eng = make(cache)
    _prefill(trunk, eng, cache, a, 0, 0, 11)
    cache.restore_prefix(1, share)
    if restore_draft:
        eng.drafter.restore(1, share)
    _prefill(trunk, eng, cache, b, 1, share, 11)
    _prefill(trunk, eng, cache, b, 2, 0, 11)  # cold
    got, cold = _draft_view(eng, 1, len(b), 11), _draft_view(eng, 2, len(b), 11)
    if restore_draft:
        torch.testing.assert_close(got, cold, atol=1e-4, rtol=1e-4)
    else:
        assert (got - cold).abs().max() > 1e-3


def test_a_hinted_branching_point_survives_a_long_prompt(dsv4_model):
    """A store of 3 states and prompts of 5 boundaries: the first request keeps only its deepest
    three, so a second request sharing 256 tokens misses (and the tree hints 256); its own prefill
    then keeps the state at 256 over its deeper boundaries, and a third request resumes there.
    Without the hint (the broken variant) the third request misses as well."""
    model = dsv4_model("flash")
    L = 640
    for hinted in (True, False):
        table, n_tok = _tables(L, 0)
        cache = DSV4Cache(model.cfg, 3, L, token_slots=table, num_token_slots=n_tok)
        store = cache.enable_prefix_states(capacity=3)
        a, b = _prompts(L, 256)
        _forward(model, cache, a, 0, 0, [L])
        slots0 = table[0].tolist()
        assert store.usable_prefix(slots0[:256], 256) == 0  # 128 and 256 were pushed out
        store.wanted = {(1, 256)} if hinted else set()  # what the backend sets from the hint
        _forward(model, cache, b, 1, 0, [L])
        store.wanted = set()
        slots1 = table[1].tolist()
        assert (store.usable_prefix(slots1[:300], 300) == 256) == hinted


def test_rekey_moves_a_state_to_the_trees_slot_unless_it_has_one(dsv4_model):
    """When SGLang's insert finds a page already in the tree it frees the request's copy: the
    state saved under the request's slot moves to the tree's slot (same tokens), and a state the
    tree's slot already has is kept."""
    cache = DSV4Cache(dsv4_model("flash").cfg, 1, 256)
    store = cache.enable_prefix_states(capacity=4)
    a, b, c = store.reserve([10, 20, 30], [128, 128, 256])
    store.rekey(10, 11, 128)
    assert store.lookup(10, 128) is None and store.lookup(11, 128) == a
    store.rekey(11, 20, 128)  # 20 has its own state at 128: kept
    assert store.lookup(11, 128) == a and store.lookup(20, 128) == b
    store.rekey(11, 30, 128)  # 30's state is for 256: the slot now ends another page, it goes
    assert store.lookup(30, 128) == a and store.lookup(30, 256) is None
