"""DSpark: the verify planner against a brute-force oracle (hypothesis), its losslessness
argument against a broken budget, and the draft block against dense per-request attention."""

from __future__ import annotations

import re
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_dsv4_ascend import settings as dsv4_settings
from sglang_dsv4_ascend.speculative import planner as P
from tests.oracles.decode import dspark_engine
from tests.oracles.dspark_oracle import Alternating, oracle_block, oracle_budget, oracle_select


def linear(c0, c_req, c_tok):
    """A synthetic verify cost t = c0 + c_req * R + c_tok * rows (any callable t(R, rows) plans)."""
    return lambda R, B: c0 + c_req * R + c_tok * B


conf_rows = st.lists(
    st.lists(st.sampled_from([0.0, 0.1, 0.3, 0.5, 0.5, 0.7, 0.9, 1.0]), min_size=4, max_size=4), min_size=1, max_size=6
)
costs = st.tuples(st.floats(0.001, 0.05), st.floats(0.0, 0.01), st.floats(0.0, 0.01))


@settings(max_examples=200, deadline=None)
@given(conf_rows, costs, st.booleans())
def test_budget_matches_oracle(lagged, c, no_cost):
    cost = None if no_cost else linear(*c)
    K = P.budget(P.survival(torch.tensor(lagged, dtype=torch.float64)), cost)
    assert K == oracle_budget(lagged, cost)
    assert 0 <= K <= len(lagged) * 4


@settings(max_examples=200, deadline=None)
@given(conf_rows, st.integers(0, 30))
def test_select_matches_oracle_and_keeps_prefixes(conf, K):
    lens = P.select(P.survival(torch.tensor(conf, dtype=torch.float64)), K)
    assert lens == oracle_select(conf, K)
    assert sum(lens) <= K
    assert lens == P.select(P.survival(torch.tensor(conf, dtype=torch.float64)), K)  # deterministic
    # more budget never verifies less of anyone (monotone)
    more = P.select(P.survival(torch.tensor(conf, dtype=torch.float64)), K + 1)
    assert all(m >= n for m, n in zip(more, lens))
    # higher confidence everywhere for request 0 never shortens it
    boosted = [[min(1.0, c + 0.2) for c in conf[0]]] + conf[1:]
    assert P.select(P.survival(torch.tensor(boosted, dtype=torch.float64)), K)[0] >= lens[0]


def test_ties_prefer_smaller_position_then_request():
    conf = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    assert P.select(P.survival(conf), 1) == [1, 0]
    assert P.select(P.survival(conf), 3) == [2, 1]


def test_planner_uses_the_lag_and_generations():
    cost = linear(0.01, 0.0, 0.004)
    pl = P.Planner(4, "adaptive", cost)
    low = torch.full((1, 4), 0.05)
    high = torch.full((1, 4), 1.0)
    # rounds 0, 1: no record two rounds back -> survival 1 everywhere -> the whole block
    assert pl.plan([3], ["a"], low) == [4]
    assert pl.plan([3], ["a"], high) == [4]
    # round 2 reads round 0's low confidences: the budget shrinks though this round is confident
    assert pl.plan([3], ["a"], high) == [0]
    assert pl.last["budget"] == 0
    # a new request in the same slot does not inherit them
    assert pl.plan([3], ["b"], high) == [4]


def test_static_and_no_cost_model_verify_everything():
    conf = torch.full((2, 4), 0.01)
    assert P.Planner(4, "static", linear(1.0, 0, 1.0)).plan([0, 1], [0, 1], conf) == [4, 4]
    assert P.Planner(4, "adaptive", None).plan([0, 1], [0, 1], conf) == [4, 4]


def _broken_budget_from_current(conf, cost):
    return P.budget(P.survival(conf), cost)


def test_broken_budget_biases_acceptance_decisions():
    """The paper's Appendix A shape: gamma 2, t(1)=1, t(2)=2, t(3)=1/0.45 (SPS 1, .5, .45) and
    a_1 = 0.8. Verifying draft 1 must not depend on draft 1 itself; a budget from the CURRENT
    confidences makes it depend on c_2, a function of x_1 (through W1[x_1]). The lagged budget
    gives the same verify decision for x_1 whatever c_2 is."""
    cost = lambda R, B: {1: 1.0, 2: 2.0, 3: 1 / 0.45}[B]  # noqa: E731
    c_good, c_bad = torch.tensor([[0.8, 0.95]]), torch.tensor([[0.8, 0.05]])
    broken = [P.select(P.survival(c), _broken_budget_from_current(c, cost)) for c in (c_good, c_bad)]
    assert broken[0][0] != broken[1][0]  # x_1's verification depends on x_1: biased
    lagged = torch.tensor([[0.5, 0.5]])
    fixed = [P.select(P.survival(c), P.budget(P.survival(lagged), cost)) for c in (c_good, c_bad)]
    assert (fixed[0][0] > 0) == (fixed[1][0] > 0)


# -- the draft block ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from sglang_dsv4_ascend.models.dspark import load_dspark_from_dir
    from sglang_dsv4_ascend.models.weights import load_model_from_dir
    from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint

    d = write_checkpoint(str(tmp_path_factory.mktemp("dspark") / "ck"), "flash", "dspark")
    trunk = load_model_from_dir(d)
    return trunk, load_dspark_from_dir(d, trunk.cfg)


def _prefill_features(trunk, draft, prompt, slot, cache, ctx):
    from sglang_dsv4_ascend.batch import Segment

    aux = {"layer_ids": trunk.cfg.dspark_target_layer_ids}
    trunk(torch.tensor(prompt), torch.arange(len(prompt)), [Segment(slot, 0, len(prompt))], cache, aux=aux)
    feats = draft.features(aux["layer_streams"])
    draft.inject(ctx, feats, torch.full((len(prompt),), slot), torch.arange(len(prompt)))
    return feats


@pytest.mark.parametrize("gamma", [4, 6])
def test_block_matches_dense_oracle(tiny, gamma):
    trunk, draft = tiny
    cache = trunk.make_cache(3, 128, 8)
    ctx = draft.make_cache(3, 8)
    prompts = {0: list(range(3, 40)), 2: list(range(50, 57))}  # longer and shorter than the window
    feats = {s: _prefill_features(trunk, draft, p, s, cache, ctx) for s, p in prompts.items()}
    slots, starts, anchors = [2, 0], [7, 37], torch.tensor([11, 99])
    U, h = draft.block(ctx, slots, starts, anchors, gamma, trunk.embed, trunk.compute_logits)
    for i, s in enumerate(slots):
        U_ref, h_ref = oracle_block(draft, feats[s], starts[i], int(anchors[i]), gamma, trunk.embed, trunk.head.weight)
        torch.testing.assert_close(U[i], U_ref, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(h[i], h_ref, atol=2e-4, rtol=2e-4)


def test_block_is_bidirectional(tiny):
    """A causal block (the broken variant) changes the anchor row's logits; ours matches the oracle."""
    from sglang_dsv4_ascend.models import dspark as D

    trunk, draft = tiny
    cache, ctx = trunk.make_cache(1, 128, 8), draft.make_cache(1, 8)
    feats = _prefill_features(trunk, draft, list(range(3, 30)), 0, cache, ctx)
    U_ref, _ = oracle_block(draft, feats, 27, 5, 4, trunk.embed, trunk.head.weight)
    orig = D.BlockContext.__init__

    def causal(self, *a, **k):
        orig(self, *a, **k)
        n_ctx = ctx.window
        g = 4
        blk = torch.arange(g).repeat(self.key_ok.shape[0] // g)
        self.key_ok[:, n_ctx:] &= torch.arange(g)[None, :] <= blk[:, None]

    D.BlockContext.__init__ = causal
    try:
        U_bad, _ = draft.block(ctx, [0], [27], torch.tensor([5]), 4, trunk.embed, trunk.compute_logits)
    finally:
        D.BlockContext.__init__ = orig
    assert not torch.allclose(U_bad[0, 0], U_ref[0], atol=1e-3)


def _binned_chi2(samples: torch.Tensor, p: torch.Tensor, nbins: int = 20) -> tuple:
    """(chi-square, degrees of freedom) of token samples against p over `nbins` bins of about equal
    mass (tokens ranked by p): a flat 1024-token distribution leaves no single token with enough
    expected counts."""
    p = p.double()
    order = torch.argsort(p, descending=True, stable=True)
    before = torch.cumsum(p[order], 0) - p[order]
    bins = torch.empty_like(order)
    bins[order] = (before * nbins).floor().long().clamp(max=nbins - 1)
    counts = torch.bincount(bins[samples], minlength=nbins).double()
    expected = torch.zeros(nbins, dtype=torch.float64).index_add_(0, bins, p) * samples.numel()
    ok = expected > 0
    return float(((counts - expected)[ok] ** 2 / expected[ok]).sum()), int(ok.sum()) - 1


def _prefilled_drafter(trunk, draft, n: int, gamma: int, generator):
    """A DSpark drafter over n slots that all hold the same 27-token prompt: (drafter, L)."""
    from sglang_dsv4_ascend.batch import Segment
    from sglang_dsv4_ascend.speculative.drafters import DSparkDrafter

    cache = trunk.make_cache(n, 128, 8)
    eng = types.SimpleNamespace(
        model=types.SimpleNamespace(model=trunk, dspark=draft, cfg=trunk.cfg),
        cache=cache,
        device=torch.device("cpu"),
        gamma=gamma,
        generator=generator,
    )
    dr = DSparkDrafter(eng)
    prompt = list(range(3, 30))
    L = len(prompt)
    segs = [Segment(s, 0, L) for s in range(n)]
    aux = {"layer_ids": dr.layer_ids}
    trunk(torch.tensor(prompt * n), torch.arange(L).repeat(n), segs, cache, aux=aux)
    dr.extend(segs, None, aux, None, [])
    return dr, L


def test_markov_draws_follow_q_and_greedy_is_argmax(tiny):
    """The drafter's sampled draft 1 is distributed as the q it reports (chi-square over 20 bins
    of equal q mass), and greedy drafts are the argmax of z = U + Markov bias. The 1500 samples
    come from 30 draft calls over 50 slots holding the same prompt: every row reports the same q,
    and each row draws its own."""

    trunk, draft = tiny
    n, calls = 50, 30
    dr, L = _prefilled_drafter(trunk, draft, n, 3, torch.Generator().manual_seed(1))
    slots, starts, anchors = list(range(n)), [L] * n, [5] * n
    g = dr.draft(slots, starts, anchors, None, None)
    U, _ = draft.block(dr.ctx, [0], [L], torch.tensor([5]), 3, trunk.embed, trunk.compute_logits)
    z1 = U[0, 0] + draft.mtp[-1].markov_head.bias(torch.tensor([5]))[0]
    assert g.draft_probs is None and all(t.tokens[1] == int(z1.argmax()) for t in g.trees)
    assert g.confidence.shape == (n, 3) and bool(((g.confidence > 0) & (g.confidence < 1)).all())
    sp = [dict(temperature=3.0)] * n
    draws = [dr.draft(slots, starts, anchors, None, sp) for _ in range(calls)]
    q = draws[0].draft_probs[0][0]
    for d in (draws[0], draws[-1]):  # the same prompt in every slot: one q for every row, every call
        torch.testing.assert_close(torch.stack([p[0] for p in d.draft_probs]), q.expand(n, -1))
    firsts = [[t.tokens[1] for t in d.trees] for d in draws]
    assert float(q.max()) < 0.5  # q is flat enough that one draw shared by all rows would show:
    assert all(len(set(row)) > 1 for row in firsts)  # the rows of a call draw independently
    chi2, dof = _binned_chi2(torch.tensor(firsts).flatten(), q)
    assert dof >= 10
    assert chi2 < dof + 6 * (2 * dof) ** 0.5, (chi2, dof)


def _chi2_ok(samples, probs) -> tuple:
    counts = torch.bincount(torch.tensor(samples), minlength=probs.numel()).double()
    expected = probs.double() * len(samples)
    chi2 = float(((counts - expected) ** 2 / expected.clamp_min(1e-12))[expected > 0].sum())
    dof = int((expected > 0).sum()) - 1
    return chi2 < dof + 5 * (2 * dof) ** 0.5 + 10, chi2


@pytest.mark.parametrize("broken", [False, True])
def test_lossless_sampling_through_the_planner(broken):
    """Statistical test of the whole plan -> verify -> accept path on a synthetic chain: two requests
    share a tight verify budget; draft 1 ~ q, and its confidence for draft 2 is high exactly when
    draft 1 is token 0 (the Markov feature). The first emitted token must follow the target p. The
    shipped planner (budget from lagged confidences) passes; a budget from the current ones fails."""
    from sglang_dsv4_ascend.speculative.accept import sample_accept
    from sglang_dsv4_ascend.speculative.tree import DraftTree

    V = 4
    p = torch.tensor([[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([0.7, 0.1, 0.1, 0.1])
    # with the current confidences the argmax budget is 3 when draft 1 is token 0, else 1 (only the
    # other request's first draft): draft 1 is then verified only when it is token 0
    cost = lambda R, B: {2: 1.0, 3: 1.0, 4: 1.3, 5: 1.5}.get(B, 10.0)  # noqa: E731
    other = torch.tensor([[0.85, 0.5]])  # the second request's confidences (independent of ours)
    gen = torch.Generator().manual_seed(7)
    firsts = []
    for _ in range(6000):
        x1 = int(torch.multinomial(q, 1, generator=gen))
        c = torch.tensor([[0.8, 0.99 if x1 == 0 else 0.01]])
        conf = torch.cat([c, other])
        lagged = P.survival(torch.tensor([[0.8, 0.99], [0.85, 0.5]]))
        K = P.budget(P.survival(conf) if broken else lagged, cost)
        n = P.select(P.survival(conf), K)[0]
        tree = DraftTree([9 % V, x1, 0][: n + 1], [-1, 0, 1][: n + 1])
        path, bonus = sample_accept(tree, p[: n + 1], gen, q.expand(2, V)[:n] if n else None)
        firsts.append(tree.tokens[1] if len(path) > 1 else bonus)
    ok, chi2 = _chi2_ok(firsts, p[0])
    assert ok != broken, (broken, chi2)


def test_bench_sps_writes_a_table_the_server_loads(tmp_path):
    import contextlib
    import io
    import json

    from sglang_dsv4_ascend.bench import sps

    out = tmp_path / "sps.json"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        # the budget only bounds the run (6 points here): a loaded machine must not cut the points short
        assert sps.main(["--gamma", "3", "--max-requests", "2", "--budget-s", "120", "--out", str(out)]) == 0
    doc = json.loads(buf.getvalue())
    assert doc["points"] and all(len(p) == 3 and p[2] > 0 for p in doc["points"])
    assert {tuple(p[:2]) for p in doc["points"]} >= {(1, 1), (1, 4)}  # rows 1 .. gamma + 1 at R = 1
    from sglang_dsv4_ascend.speculative import cost as C

    m = C.load(str(out))
    assert m(1, 4) == pytest.approx(doc["predicted_s"][[tuple(p[:2]) for p in doc["points"]].index((1, 4))], abs=1e-6)
    assert m.draft_s is not None and all(t > 0 for _, t in doc["draft_points"])  # the DSpark draft step, timed


@pytest.mark.parametrize("wrong_q", [False, True])
def test_engine_sampling_with_the_real_draft_is_lossless(tiny, monkeypatch, wrong_q):
    """Sampled DSpark rounds (real draft, Markov q, adaptive planner, chain rejection) emit their
    first token distributed as the target's next-token distribution (chi-square over 20 bins),
    with drafts accepted in a good share of the rounds (else the test would prove nothing). The
    broken variant hands the accept rule a flattened q (not the distribution the drafts were
    drawn from): caught. The 2400 samples come from 24 rounds of 100 requests in their own slots
    with the same prompt and bonus token: each request's first token follows p whatever the others
    draw (whether its draft 1 is verified depends on the lagged budget and the other requests'
    draws, never on its own), so a round gives 100 independent samples. The planner's confidence
    calibration refits every other drafted round, so its offsets move throughout."""
    from sglang_dsv4_ascend.speculative import engine as E

    if wrong_q:
        real = E.accept_batch

        def flattened(trees, rows, sampling, gen, qs=None):
            qs = None if qs is None else [None if q is None else q.sqrt() / q.sqrt().sum(-1, keepdim=True) for q in qs]
            return real(trees, rows, sampling, gen, qs)

        monkeypatch.setattr(E, "accept_batch", flattened)
    from sglang_dsv4_ascend.batch import Segment
    from sglang_dsv4_ascend.speculative.accept import target_probs

    trunk, draft = tiny
    gamma, T, n, rounds = 2, 0.7, 100, 24
    # a verify costs 0.01 s per request: each request trades its rows as a lone one would; in the
    # lossless variant every other round skips drafting (a plain decode step in between)
    planner = P.Planner(gamma, "adaptive", linear(0.0, 0.01, 0.001) if wrong_q else Alternating())
    planner.calibration.every = 2  # confidences recalibrated from the rounds' outcomes throughout
    eng = dspark_engine(trunk, draft, n, gamma, planner, seed=3)
    cache = eng.cache
    prompt = list(range(3, 30))
    L, anchor = len(prompt), 7
    segs = [Segment(s, 0, L) for s in range(n)]  # n requests with the same prompt and bonus token
    aux = {"layer_ids": eng.drafter.layer_ids}
    trunk(torch.tensor(prompt * n), torch.arange(L).repeat(n), segs, cache, aux=aux)
    eng.extend(segs, None, aux, None, [])
    h = trunk(torch.tensor([anchor]), torch.tensor([L]), [Segment(0, L, 1)], cache, pending=[])
    p = target_probs(trunk.compute_logits(h), T, -1, 1.0, 0.0)[0]
    slots, rids = list(range(n)), [f"req{s}" for s in range(n)]
    firsts, accepted, skipped = [], 0, 0
    for _ in range(rounds):  # every round restarts from the same committed state (writes are at >= L)
        r = eng.round(slots, [L] * n, [anchor] * n, [dict(temperature=T)] * n, None, rids)
        firsts += [e[0] for e in r.emitted]
        accepted += sum(a > 1 for a in r.accept_lens)
        skipped += r.plan["skipped_draft"]
    assert accepted > 0.05 * len(firsts), accepted
    assert skipped == (0 if wrong_q else rounds // 2)
    assert bool(planner.calibration.shift.any())
    chi2, dof = _binned_chi2(torch.tensor(firsts), p)
    assert dof >= 10
    assert (chi2 < dof + 6 * (2 * dof) ** 0.5) != wrong_q, (chi2, dof)


def test_bad_settings_name_what_is_wrong(tmp_path, monkeypatch):
    from sglang_dsv4_ascend.models.dspark import load_sts

    bad = tmp_path / "sts.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="--speculative-dspark-confidence-sts-path .*sts.json: cannot read"):
        load_sts(str(bad))
    bad.write_text('{"temperatures": [1.0, -2]}')
    with pytest.raises(ValueError, match="--speculative-dspark-confidence-sts-path .*positive numbers"):
        load_sts(str(bad))
    bad.write_text('{"temperatures": [1.5, 0.8]}')
    assert load_sts(str(bad)) == [1.5, 0.8]
    with pytest.raises(ValueError, match="SGLANG_DSV4_DSPARK_VERIFY='fast': expected one of static, adaptive"):
        P.Planner(4, "fast")
    monkeypatch.setenv(dsv4_settings.DSPARK_VERIFY.name, "compact")
    with pytest.raises(ValueError, match="SGLANG_DSV4_DSPARK_VERIFY='compact'"):
        P.verify_mode()


def test_inject_of_a_chunk_longer_than_the_ring_keeps_its_last_positions(tiny):
    """A prefill chunk longer than the context ring: each ring row holds the K/V of the last
    position that maps to it (writing every position in one index_put would collide, and which
    colliding row lands is unspecified)."""
    trunk, draft = tiny
    ctx = draft.make_cache(2, 4)
    n = 3 * ctx.ring + 5
    feat = torch.randn(n, trunk.cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    pos = torch.arange(n)
    draft.inject(ctx, feat, torch.ones(n, dtype=torch.long), pos)
    for s, stage in enumerate(draft.mtp):
        kv = stage.inject(feat, pos)
        for p in range(n - ctx.ring, n):
            torch.testing.assert_close(ctx.rings[s, 1, p % ctx.ring], kv[p].to(ctx.rings.dtype))
        assert ctx.rings[s, 0].abs().sum() == 0  # another slot is untouched


@pytest.mark.parametrize("broken", [False, True])
def test_rank_check_covers_every_request_of_a_round(tiny, monkeypatch, broken):
    """SGLANG_DSV4_SPEC_SYNC_CHECK's per-round record (engine.round_decisions) covers every request:
    two requests, a fake second rank whose decisions differ from ours in the second request only
    (its bonus token, or its accepted path); the round must stop with DesyncError naming what
    differs. The broken record (the first request's decisions only, as a review found it once
    could be without any test noticing) lets the desync through: caught."""
    from sglang_dsv4_ascend.batch import Segment
    from sglang_dsv4_ascend.distributed import spec_sync
    from sglang_dsv4_ascend.speculative import engine as E

    if broken:
        real = E.round_decisions

        def first_only(drafts, plan, out):
            return {k: v[:1] if isinstance(v, list) else v for k, v in real(drafts, plan, out).items()}

        monkeypatch.setattr(E, "round_decisions", first_only)
    seen = []

    def other_rank(everyone, decisions, group=None):
        seen.append(decisions)
        theirs = {
            k: [list(x) if isinstance(x, list) else x for x in v] if isinstance(v, list) else v
            for k, v in decisions.items()
        }
        if len(theirs["bonus"]) > 1:
            theirs["bonus"][1] += 1
        everyone[:] = [decisions, theirs]

    monkeypatch.setattr(spec_sync.torch.distributed, "all_gather_object", other_rank)
    trunk, draft = tiny
    eng = dspark_engine(trunk, draft, 2, 3, P.Planner(3, "static", None))
    eng.sync = spec_sync.RankSync(rank=0, size=2, check=True)
    prompts = [list(range(3, 30)), list(range(40, 61))]
    segs = [Segment(s, 0, len(p)) for s, p in enumerate(prompts)]
    aux = {"layer_ids": eng.drafter.layer_ids}
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    trunk(torch.tensor(sum(prompts, [])), pos, segs, eng.cache, aux=aux)
    eng.extend(segs, None, aux, None, [])
    try:
        r = eng.round([0, 1], [len(p) for p in prompts], [5, 9], None, None, ["a", "b"])
        caught = None
    except spec_sync.DesyncError as e:
        caught = str(e)
    assert (caught is not None) != broken, caught  # the broken record lets request b's desync through
    if broken:
        assert len(seen[-1]["bonus"]) == 1 and len(r.bonus) == 2
        return
    assert re.search(r"'bonus' is \[\d+, \d+\] on rank 0 and \[\d+, \d+\] on rank 1", caught), caught
    rec = seen[-1]
    assert len(rec["drafted"]) == len(rec["paths"]) == len(rec["accept_lens"]) == len(rec["bonus"]) == 2
    assert [t[0] for t in rec["drafted"]] == [5, 9] and all(len(t) == 4 for t in rec["drafted"])
    assert all(p[0] == 0 and len(p) == a for p, a in zip(rec["paths"], rec["accept_lens"]))


def _lagged_markov_chain(self, U, h, anchors, temps, generator):
    """Broken: draft k's Markov bias and confidence read x_{k-2} instead of x_{k-1}."""
    n, gamma = U.shape[:2]
    sampled = [i for i, t in enumerate(temps) if t is not None]
    T = torch.tensor([temps[i] for i in sampled], dtype=torch.float32).view(-1, 1)
    before = prev = anchors
    xs, cs, qs = [], [], [[] for _ in range(n)]
    for k in range(1, gamma + 1):
        z = U[:, k - 1] + self.mtp[-1].markov_head.bias(before)
        cs.append(self.confidence(h[:, k - 1], before, k))
        x = z.argmax(dim=-1)
        if sampled:
            q = torch.softmax(z[sampled] / T, dim=-1)
            x[sampled] = torch.multinomial(q, 1, generator=generator).view(-1)
            for j, i in enumerate(sampled):
                qs[i].append(q[j])
        xs.append(x)
        before, prev = prev, x
    return torch.stack(xs, dim=1), [torch.stack(q) if q else None for q in qs], torch.stack(cs, dim=1)


@pytest.mark.parametrize("broken", [False, True])
@torch.no_grad()
def test_every_draft_position_follows_the_markov_head(tiny, monkeypatch, broken):
    """Every draft position k of the chain, not only the first, against the definition recomputed
    here from the block's U, h and the head's weights: z_k = U_k + W2 W1[x_{k-1}] with x_{k-1} the
    draft actually chosen before it. Greedy drafts are argmax z_k and c_k reads x_{k-1}; sampled
    drafts report q_k = softmax(z_k / T) for their own x_{k-1}, and positions 2 and 3 are drawn from
    it (randomized probability integral transform: uniform over 20 bins, chi-square, 1200 draws
    each from 40 rows that report different q's). A loop conditioned on x_{k-2}: caught."""
    from sglang_dsv4_ascend.models.dspark import DSparkDraft

    if broken:
        monkeypatch.setattr(DSparkDraft, "markov_chain", _lagged_markov_chain)
    trunk, draft = tiny
    n, gamma, T = 40, 3, 3.0
    gen = torch.Generator().manual_seed(2)
    dr, L = _prefilled_drafter(trunk, draft, n, gamma, gen)
    slots, anchors = list(range(n)), [(7 * s) % 50 + 1 for s in range(n)]  # a different q per row
    U, h = draft.block(dr.ctx, slots, [L] * n, torch.tensor(anchors), gamma, trunk.embed, trunk.compute_logits)
    head = draft.mtp[-1].markov_head
    W1, W2 = head.markov_w1.weight.float(), head.markov_w2.weight.float()

    def z(i, k, prev):  # the definition, from the weights
        return U[i, k - 1].float() + W2 @ W1[prev]

    faults = []
    g = dr.draft(slots, [L] * n, anchors, None, None)
    for i, t in enumerate(g.trees):
        x = list(t.tokens)  # [a, x_1, .., x_gamma]
        for k in range(1, gamma + 1):
            if x[k] != int(z(i, k, x[k - 1]).argmax()):
                faults.append(("greedy", i, k))
            c = torch.sigmoid(draft.mtp[-1].confidence_head(torch.cat([h[i, k - 1].float(), W1[x[k - 1]]])))
            if not torch.allclose(g.confidence[i, k - 1], c.squeeze(), atol=1e-5):
                faults.append(("confidence", i, k))
    pit = {2: [], 3: []}
    for _ in range(30):
        d = dr.draft(slots, [L] * n, anchors, None, [dict(temperature=T)] * n)
        for i, t in enumerate(d.trees):
            x = list(t.tokens)
            for k in range(1, gamma + 1):
                q = torch.softmax(z(i, k, x[k - 1]) / T, dim=-1)
                if not torch.allclose(d.draft_probs[i][k - 1].float(), q, atol=1e-5):
                    faults.append(("q", i, k))
                if k in pit:  # uniform on [F(x-), F(x)] under the q the draft was drawn from
                    lo = float(q[: x[k]].sum())
                    pit[k].append(lo + float(torch.rand((), generator=gen)) * float(q[x[k]]))
    for k, u in pit.items():
        counts = torch.bincount((torch.tensor(u) * 20).long().clamp(max=19), minlength=20).double()
        chi2 = float(((counts - len(u) / 20) ** 2 / (len(u) / 20)).sum())
        if chi2 > 19 + 6 * 38**0.5:
            faults.append(("pit", k, round(chi2, 1)))
    assert bool(faults) == broken, faults[:5]
    if broken:
        assert {f[0] for f in faults} >= {"greedy", "q"}
