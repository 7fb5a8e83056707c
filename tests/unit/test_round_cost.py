"""The round cost surface and the decisions it drives (speculative/cost.py, planner.Planner.decide):
SGLang's own budget as the differential oracle and its table files, the planner on synthetic
surfaces (rows free, rows expensive, drafting dearer than its gain), online refinement against a
known surface with outliers, and rounds that skip drafting kept lossless in the engine."""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_dsv4_ascend.speculative import cost as C
from sglang_dsv4_ascend.speculative import planner as P
from tests.oracles.decode import dspark_engine, plain_greedy
from tests.oracles.dspark_oracle import Alternating

sgp = pytest.importorskip("sglang.srt.speculative.dspark_components.dspark_planner")
sgs = pytest.importorskip("sglang.srt.speculative.dspark_components.dspark_sps")


def _probes(lo, hi, max_size):
    return st.lists(st.integers(lo, hi), min_size=1, max_size=max_size, unique=True).map(sorted)


@st.composite
def additive_tables(draw):
    bs, ms = draw(_probes(1, 32, 5)), draw(_probes(1, 200, 8))
    seconds = st.floats(0.0, 0.05, allow_nan=False)
    alpha = draw(st.lists(seconds, min_size=len(bs), max_size=len(bs)))
    theta = draw(st.lists(seconds, min_size=len(ms), max_size=len(ms)))
    return draw(st.floats(1e-4, 0.05)), bs, alpha, ms, theta


@st.composite
def steps_tables(draw):
    xs = draw(_probes(1, 200, 8))
    return xs, draw(st.lists(st.floats(1.0, 1000.0), min_size=len(xs), max_size=len(xs)))


@st.composite
def survivals(draw):
    R, gamma = draw(st.integers(1, 8)), draw(st.integers(1, 6))
    conf = st.sampled_from([0.0, 1e-7, 0.05, 0.3, 0.5, 0.77, 0.9, 0.99, 1.0])
    rows = draw(st.lists(st.lists(conf, min_size=gamma, max_size=gamma), min_size=R, max_size=R))
    return P.survival(torch.tensor(rows, dtype=torch.float64))


def _sglang_budget(surv, table):
    cfg = sgp.DSparkScheduleConfig(gamma=surv.shape[1])
    return sgp.compute_verify_token_budget(history_survival_probs=surv, sps_table=table, cfg=cfg)


@settings(max_examples=300, deadline=None)
@given(survivals(), additive_tables())
def test_budget_equals_sglangs_for_its_additive_table(surv, t):
    bias, bs, alpha, ms, theta = t
    ours = C.RoundCost(bias, bs, alpha, ms, theta)
    ref = _sglang_budget(surv, sgs.SpsAdditiveCostTable(bias, bs, alpha, ms, theta))
    K, tps = P._best(surv, ours)
    assert K == ref.budget
    assert tps == pytest.approx(ref.predicted_theta, rel=1e-12)
    # and the table's step time is SGLang's at every budget
    R = surv.shape[0]
    table = sgs.SpsAdditiveCostTable(bias, bs, alpha, ms, theta)
    for k in (0, 1, 5, 40):
        assert ours(R, R + k) == pytest.approx(table.step_time(num_reqs=R, budget=k), rel=1e-12)


@settings(max_examples=200, deadline=None)
@given(survivals(), steps_tables())
def test_budget_equals_sglangs_for_its_steps_table(surv, t):
    xs, sps = t
    ref = _sglang_budget(surv, sgs.SpsCostTable(xs, sps, max(xs)))
    assert P.budget(surv, C.StepsTable(xs, sps)) == ref.budget


def test_a_budget_that_forgets_the_anchor_rows_is_caught():
    """The broken variant prices k drafts as k rows instead of R + k (the anchors forgotten): on a
    surface whose rows cost jumps past 6, 4 requests at survival 0.9 diverge from SGLang's."""
    surv = P.survival(torch.full((4, 4), 0.9, dtype=torch.float64))
    args = (0.001, [1, 16], [0.0, 0.0], [1, 6, 7, 64], [0.0, 0.0, 0.05, 0.05])
    ref = _sglang_budget(surv, sgs.SpsAdditiveCostTable(*args)).budget
    good = C.RoundCost(*args)
    assert P.budget(surv, good) == ref
    broken = lambda R, rows: good(R, rows - R)  # noqa: E731
    assert P.budget(surv, broken) != ref


def test_sglang_table_files_load_and_ours_load_in_sglang(tmp_path):
    add = sgs.SpsAdditiveCostTable(0.002, [1, 4, 16], [0.0, 0.001, 0.003], [1, 8, 64], [0.0, 0.0008, 0.004])
    path = tmp_path / "additive.json"
    path.write_text(add.to_json())
    ours = C.load(str(path))
    for R, m in ((1, 1), (3, 7), (16, 80), (40, 300)):
        assert ours(R, m) == pytest.approx(add.step_time(num_reqs=R, budget=m - R), rel=1e-12)
    assert ours.draft_s is None and not P.Planner(4, cost=ours).decide([0, 1], [0, 1]).skip  # no drafting cost
    steps = sgs.SpsCostTable([1, 8, 32], [100.0, 60.0, 20.0], 64)
    path.write_text(steps.to_json())
    assert C.load(str(path))(2, 9) == pytest.approx(1 / steps.lookup(9))
    # ours, with its draft term, is a valid SGLang additive table file
    mine = C.RoundCost(0.002, [1, 16], [0.0, 0.002], [1, 64], [0.0, 0.003], [0.001, 0.004])
    back = sgs.load_sps_table_from_path(_write(tmp_path / "mine.json", mine.to_json()))
    assert back.step_time(num_reqs=5, budget=7) == pytest.approx(mine(5, 12), rel=1e-12)
    assert C.load(str(tmp_path / "mine.json")).draft(16) == pytest.approx(0.004)
    for bad in (
        "{}",
        '{"bias_seconds": 0, "bs_probes": [1], "alpha_seconds": [0], "m_probes": [1], "theta_seconds": [0]}',
        '{"sample_batch_tokens": [4, 2], "sample_steps_per_sec": [1, 1]}',
    ):
        with pytest.raises(ValueError, match="--speculative-dspark-sps-table-path"):
            C.load(_write(tmp_path / "bad.json", bad))


def _write(path, text):
    path.write_text(text if isinstance(text, str) else json.dumps(text))
    return str(path)


# -- the planner on synthetic surfaces --------------------------------------------------------------


def _surface(theta_per_row, draft, c0=0.01):
    """t(R, m) = c0 + draft + theta_per_row * (m - 1): a round's time includes its drafting."""
    return C.RoundCost(c0, [1, 16], [draft, draft], [1, 128], [0.0, theta_per_row * 127], [draft, draft])


def test_rows_free_verify_everything_rows_dear_anchors_only():
    pl = P.Planner(4, cost=_surface(0.0, 0.001))
    d = pl.decide([0, 1, 2], ["a", "b", "c"])  # no records yet: survival 1 everywhere
    assert (d.budget, d.skip) == (12, False)
    dear = P.Planner(4, cost=C.RoundCost(0.01, [1, 16], [0, 0], [1, 128], [0, 127.0]))  # drafting's cost unknown
    d = dear.decide([0, 1, 2], ["a", "b", "c"])
    assert (d.budget, d.skip) == (0, False)
    assert dear.plan([0, 1, 2], ["a", "b", "c"], torch.ones(3, 4), d) == [0, 0, 0]


@settings(max_examples=200, deadline=None)
@given(survivals(), additive_tables(), _probes(1, 60, 3))
def test_under_graphs_the_budget_fills_its_bucket(surv, t, buckets):
    """A captured verify runs at its bucket's rows (cost.Padded): the budget is the brute-force
    argmax of tokens per second priced there, and it leaves no free row of its bucket unverified
    while drafts are left. The broken variant (priced at its own rows) leaves some."""
    R = surv.shape[0]
    pad = lambda m: next((b for b in buckets if b >= m), m)  # noqa: E731
    table = C.RoundCost(*t)
    pl = P.Planner(surv.shape[1], cost=table)
    pl.pad = pad
    s = sorted((x for x in surv.flatten().tolist() if x >= P.EPS), reverse=True)
    tps = [(R + sum(s[:k])) / table(R, pad(R + k)) for k in range(len(s) + 1)]
    K = P.budget(surv, pl.cost)
    assert K == tps.index(max(tps))
    if R + K <= buckets[-1] and K < len(s):
        assert pad(R + K) == R + K  # a whole bucket
    # the skip-draft price is the bucket's too: a plain step of R rows runs at pad(R)
    assert pl.cost.plain(R) == pytest.approx(max(1e-9, table(R, pad(R)) - table.draft(R)))


def test_a_budget_priced_at_its_own_rows_leaves_the_bucket_padding():
    """The broken variant of the above on one case: 4 ms a row, one request at survival 0.2 per
    draft; with a 5-row bucket captured every draft is free, without it none pays."""
    table = _surface(0.004, 0.0)
    surv = P.survival(torch.full((1, 4), 0.2, dtype=torch.float64))
    pl = P.Planner(4, cost=table)
    assert P.budget(surv, pl.cost) == 0
    pl.pad = lambda m: 5 if m <= 5 else m
    assert P.budget(surv, pl.cost) == 4
    pl.use(table)  # refined online: rounds are recorded at the rows they ran at
    pl.observe(1, 3, 0.02, 0.001)
    assert list(pl.online.cells) == [(1, 5)]


def test_a_draft_dearer_than_its_gain_is_skipped_and_explored():
    """Rows cost nothing but drafting costs 5x the rest of the round: four drafts at survival 1 (5
    tokens per round) do not pay 6x the time, so the round runs without drafting; every 32nd
    consecutive skip drafts anyway (the records stay current); a cheap draft is never skipped."""
    pl = P.Planner(4, cost=_surface(0.0, 0.05))
    decisions = [pl.decide([0], ["a"]) for _ in range(64)]
    for d in decisions:
        pl.plan([0], ["a"], None if d.skip else torch.ones(1, 4), d)
    assert [i for i, d in enumerate(decisions) if not d.skip] == [31, 63]
    assert decisions[0].plain_tps > decisions[0].spec_tps
    assert pl.last["predicted_seconds"] == pytest.approx(0.01 + 0.05)  # the last round drafted
    cheap = P.Planner(4, cost=_surface(0.0, 0.005))
    assert not cheap.decide([0], ["a"]).skip


def test_a_skipped_round_leaves_the_latest_older_record_to_read():
    """Records come from drafted rounds only; a round reads a request's latest record from round
    <= now - LAG (the one LAG rounds ago when every round drafts)."""
    pl = P.Planner(4, cost=_surface(0.001, 0.0))
    low, high = torch.full((1, 4), 0.05), torch.ones(1, 4)
    pl.plan([0], ["a"], low)  # round 0: drafted, low confidence
    pl.plan([0], ["a"], None, P.Decision(0, skip=True))  # round 1: skipped
    pl.plan([0], ["a"], None, P.Decision(0, skip=True))  # round 2: skipped, reads round 0
    assert pl.lagged([0], ["a"])[0, 0] == pytest.approx(0.05)  # round 3 reads round 0 (1 has none)
    pl.plan([0], ["a"], high)  # round 3: drafted
    pl.plan([0], ["a"], high)  # round 4
    assert pl.lagged([0], ["a"])[0, 0] == pytest.approx(1.0)  # round 5 reads round 3
    assert pl.lagged([0], ["b"])[0, 0] == 1.0 and len(pl.history[0]) <= P.LAG + 1


# -- online refinement ------------------------------------------------------------------------------


def _truth(R, m):
    return 0.002 + 0.0004 * R + 0.0001 * m + 2e-5 * m**1.5


def _feed(online, rounds, rng, outliers=0.05):
    for _ in range(rounds):
        R = rng.randint(1, 16)
        m = rng.randint(R, 5 * R)
        t = _truth(R, m) * rng.uniform(0.95, 1.05)
        if rng.random() < outliers:
            t *= rng.choice([8.0, 30.0])  # a GC pause, a page fault storm
        online.observe(R, m, t + 0.001 * R, 0.001 * R)


def _worst_error(cost):
    pts = [(R, m) for R in (1, 2, 4, 8, 12, 16) for m in (R, 2 * R, 3 * R, 5 * R)]
    return max(abs(cost(R, m) - (_truth(R, m) + 0.001 * R)) / (_truth(R, m) + 0.001 * R) for R, m in pts)


def test_online_refinement_converges_and_ignores_outliers():
    """Seeded 2x off and flat in R, fed 3000 rounds of a known convex surface with 5% of them 8-30x
    slow: the surface comes within 8% of the truth everywhere the batch sizes visited, the draft
    term within 5%, and its memory stays bounded. The broken variant (each cell its last sample,
    nothing dropped) is pulled off by the outliers."""
    seed = C.from_points([(1, 1, 0.01), (16, 80, 0.02)], 16, 80, [(1, 0.002), (16, 0.002)])
    online = C.OnlineCost(seed, max_cells=200)
    assert _worst_error(online.cost) > 0.3
    _feed(online, 3000, random.Random(0))
    assert _worst_error(online.cost) < 0.08, _worst_error(online.cost)
    assert online.cost.draft(8) == pytest.approx(0.008, rel=0.05)
    assert online.dropped > 100 and online.refits == 3000 // online.every + len(online.early)
    assert len(online.cells) <= 200
    broken = C.OnlineCost(seed, keep=1, outlier=1e9, max_cells=200)
    _feed(broken, 3000, random.Random(0))
    assert _worst_error(broken.cost) > 0.15, _worst_error(broken.cost)


def test_a_seed_off_by_a_third_is_corrected_within_four_rounds():
    """A startup seed 35 % below the rounds (what this CPU measured: the seed times the verify stage
    and the draft alone, best of two): four rounds of one batch size bring that batch size's
    prediction within 10 % of the rounds, and the refit stays within 10 % while every 16th round
    refits again. The broken variant (refits every 16 rounds only) still predicts the seed after
    four rounds."""

    def rounds(online, n, rng):
        for _ in range(n):
            online.observe(4, 12, 1.35 * (_truth(4, 12) + 0.004) * rng.uniform(0.97, 1.03), 0.004)

    seed = C.from_points([(R, m, _truth(R, m) + 0.001 * R) for R in (1, 4, 16) for m in (R, 5 * R)], 16, 80)
    seed.draft_s = [0.001 * p for p in seed.bs_probes]
    want = 1.35 * (_truth(4, 12) + 0.004)
    online = C.OnlineCost(seed)
    rng = random.Random(5)
    rounds(online, 4, rng)
    assert online.cost(4, 12) == pytest.approx(want, rel=0.1)
    rounds(online, 28, rng)
    assert online.cost(4, 12) == pytest.approx(want, rel=0.1)
    broken = C.OnlineCost(seed, early=())
    rounds(broken, 4, random.Random(5))
    assert broken.cost(4, 12) < 0.8 * want


def test_a_coarse_table_is_refined_between_and_beyond_its_probes(monkeypatch):
    """A table probed at R in [1, 2] and m in [1, 64] (as SGLang's profiler may write one, or one
    measured on a smaller server) cannot bend where the truth does nor reach R = 16: the refit
    adds the default grid up to the batches the rounds reached and comes within 8% everywhere.
    The broken variant refits on the table's own probes only."""
    seed = C.RoundCost(0.005, [1, 2], [0.0, 0.0004], [1, 64], [0.0, 0.01], [0.001, 0.002])
    online = C.OnlineCost(seed)
    _feed(online, 3000, random.Random(0))
    assert _worst_error(online.cost) < 0.08, _worst_error(online.cost)
    assert online.cost.bs_probes[-1] == 16 and online.cost.m_probes[-1] == 80
    monkeypatch.setattr(C, "_knots", lambda probes, reached: list(probes))
    broken = C.OnlineCost(seed)
    _feed(broken, 3000, random.Random(0))
    assert _worst_error(broken.cost) > 0.3, _worst_error(broken.cost)


def test_a_seed_far_off_everywhere_is_replaced_not_defended():
    """A seed 6x too slow everywhere (measured on a loaded machine): every round looks like an
    outlier, and dropping them all would keep the wrong surface forever; once most recent rounds
    are that far off they are kept, and the surface converges."""
    seed = C.from_points([(R, m, 6 * (_truth(R, m) + 0.001 * R)) for R in (1, 4, 16) for m in (R, 5 * R)], 16, 80)
    online = C.OnlineCost(seed)
    assert _worst_error(online.cost) > 3
    _feed(online, 600, random.Random(3), outliers=0.0)
    assert _worst_error(online.cost) < 0.1, _worst_error(online.cost)


def test_ranks_plan_with_rank_zeros_refit():
    """Each rank times its own rounds; `agree` (RankSync.broadcast in the worker) hands every rank
    the same refit, so their plans agree even though their timings differ."""
    box = {}

    def agree_as(rank):
        def agree(cost):
            if rank == 0:
                box["c"] = cost
            return box["c"]

        return agree

    calls = [0, 0]

    def counted(rank, agree):
        def f(cost):
            calls[rank] += 1
            return agree(cost)

        return f

    seed = C.from_points([(1, 1, 0.01), (16, 80, 0.02)], 16, 80, [(1, 0.002), (16, 0.002)])
    ranks = [C.OnlineCost(seed, agree=counted(r, agree_as(r))) for r in (0, 1)]
    # rank 1's clock is 10x off (every round an outlier at first): it keeps no cells for a while,
    # yet joins every collective
    rngs = [random.Random(1), random.Random(2)]
    for i in range(10):
        for r, (online, rng) in enumerate(zip(ranks, rngs)):  # rank 0 first, as a broadcast orders them
            if r == 1 and i < 2:
                for _ in range(16):
                    online.observe(4, 8, 10 * _truth(4, 8), 0.001)
            else:
                _feed(online, 16, rng)
        assert ranks[0].cost == ranks[1].cost
    assert calls == [10 + len(ranks[0].early)] * 2


# -- confidence calibration -------------------------------------------------------------------------


def _rounds(cal, truth, raw, rounds, lens, rng):
    """`rounds` rounds of 16 requests: raw confidences around `raw`, each verifying `lens` drafts
    accepted with conditional probabilities `truth` (position by position, stop at a reject)."""
    for _ in range(rounds):
        conf = (torch.full((16, 4), raw) + 0.1 * torch.rand(16, 4, generator=rng) - 0.05).clamp(0.01, 0.99)
        accepted = []
        for _ in range(16):
            a = 0
            while a < lens and torch.rand(1, generator=rng).item() < truth[a]:
                a += 1
            accepted.append(a)
        cal.learn(conf, [lens] * 16, accepted)


def test_calibration_learns_what_the_head_underestimates(monkeypatch):
    """A head that says 0.5 where 0.85 then 0.6 of drafts are accepted (the shipped tiny model's
    is this far off): after 64 rounds that verify two drafts, calibrated confidences are within 0.05
    of the conditional acceptance at both positions, and the positions never verified borrow the
    last one's offset. The broken variant counts a draft after a rejected one as rejected (the
    unconditional rate, 0.51): caught."""
    truth = [0.85, 0.6, 0.6, 0.6]
    cal = P.Calibration(4)
    _rounds(cal, truth, 0.5, 64, 2, torch.Generator().manual_seed(0))
    got = cal.apply(torch.full((1, 4), 0.5))[0].tolist()
    assert got[0] == pytest.approx(0.85, abs=0.05) and got[1] == pytest.approx(0.6, abs=0.05), got
    assert got[2] == got[3] == got[1]
    monkeypatch.setattr(P, "observed", lambda verified, accepted: range(verified))
    broken = P.Calibration(4)
    _rounds(broken, truth, 0.5, 64, 2, torch.Generator().manual_seed(0))
    assert abs(broken.apply(torch.full((1, 4), 0.5))[0, 1].item() - 0.6) > 0.05


def test_calibrated_planner_verifies_what_pays_and_ranks_agree():
    """Same head, rows priced so that a 0.5-survival draft does not pay and a 0.85 one does: on the
    head's word the planner verifies anchors only, and once its rounds have shown the bias it
    verifies first drafts. Each refit is rank 0's (`agree`), as for the cost surface."""
    # 1.2 ms a row on a 28 ms round of 16: a draft pays above survival ~0.69 (0.5 < 0.69 < 0.85)
    cost = C.RoundCost(0.01, [1, 16], [0.0, 0.0], [1, 80], [0.0, 0.0012 * 79])
    seen = []
    pl = P.Planner(4, cost=cost)
    pl.use(cost, online=False, agree=lambda b: seen.append(b) or b)
    rng = torch.Generator().manual_seed(1)
    slots, gens = list(range(16)), list(range(16))
    plans = []
    for _ in range(48):
        lens = pl.plan(slots, gens, torch.full((16, 4), 0.5))
        plans.append(lens)
        pl.learn([int(torch.rand(1, generator=rng).item() < 0.85) if n else 0 for n in lens])
    # rounds 0-1 have no lagged record (survival 1: verify all, and learn from it); rounds 2-15
    # plan on the raw 0.5 (anchors only); the refit after round 15 has seen the bias
    assert sum(plans[0]) == 64 and sum(plans[2]) == sum(plans[15]) == 0, plans[:16]
    assert sum(lens) >= 16, lens
    assert seen and torch.equal(seen[-1], pl.calibration.shift)


# -- rounds that skip drafting, in the engine ---------------------------------------------------------


_SHIPPED = {}


def _shipped(dtype=torch.float32):
    """The shipped trained tiny model and its DSpark draft in `dtype`, loaded once per module."""
    if dtype not in _SHIPPED:
        from sglang_dsv4_ascend import TINY_MODEL_PATH
        from sglang_dsv4_ascend.models.dspark import load_dspark_from_dir
        from sglang_dsv4_ascend.models.weights import load_model_from_dir

        trunk = load_model_from_dir(TINY_MODEL_PATH, dtype=dtype)
        _SHIPPED[dtype] = trunk, load_dspark_from_dir(TINY_MODEL_PATH, trunk.cfg, dtype=dtype)
    return _SHIPPED[dtype]


@pytest.fixture(scope="module")
def shipped():
    return _shipped()


def test_the_startup_seed_measures_the_corners_whatever_the_budget(shipped):
    """With no time to spare (a loaded machine) the seed still holds the fewest and the most
    requests at the fewest and the most rows, so the largest batches are measured, not
    extrapolated from small ones; with time, the points between are measured too."""
    trunk, _ = shipped
    cache = trunk.make_cache(1, 128, 5)
    rushed = P.measure_cost(trunk, cache, 4, max_requests=16, budget_s=0.0)
    assert sorted((r, m) for r, m, _ in rushed.points) == [(1, 1), (1, 5), (16, 16), (16, 80)]
    assert all(t > 0 for *_, t in rushed.points) and rushed(16, 80) > rushed(1, 1)
    full = P.measure_cost(trunk, cache, 4, max_requests=4, budget_s=60.0)
    assert sorted((r, m) for r, m, _ in full.points) == [(R, R * k) for R in (1, 2, 4) for k in (1, 3, 5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_greedy_with_skipped_drafts_equals_plain_decoding(dtype):
    """Greedy DSpark rounds with drafting skipped every other round emit exactly plain greedy
    decoding of the trained tiny model, in fp32 and in the checkpoint's own bf16, the drafter is
    not called on skipped rounds, and the drafted rounds still accept drafts (so the draft state
    kept current through the skipped ones)."""
    from sglang_dsv4_ascend.batch import Segment

    trunk, draft = _shipped(dtype)
    gamma, n_new = 4, 24
    prompts = [[5, 17, 99, 3, 250, 8, 41, 7, 66], [12, 13, 14, 15, 16, 17, 18, 19]]
    want = plain_greedy(trunk, prompts, n_new, gamma + 1)
    eng = dspark_engine(trunk, draft, 2, gamma, P.Planner(gamma, cost=Alternating()))
    cache = eng.cache
    calls = []
    real_draft = eng.drafter.draft
    eng.drafter.draft = lambda *a, **k: calls.append(1) or real_draft(*a, **k)
    aux = {"layer_ids": eng.drafter.layer_ids}
    segs = [Segment(b, 0, len(p)) for b, p in enumerate(prompts)]
    h = trunk(torch.tensor(sum(prompts, [])), torch.cat([torch.arange(len(p)) for p in prompts]), segs, cache, aux=aux)
    ends = torch.tensor([len(prompts[0]) - 1, len(prompts[0]) + len(prompts[1]) - 1])
    bonus = trunk.compute_logits(h[ends]).argmax(-1).tolist()
    shifted = prompts[0][1:] + [bonus[0]] + prompts[1][1:] + [bonus[1]]
    eng.extend(segs, torch.tensor(shifted), aux, None, [(0, int(ends[0])), (1, int(ends[1]))])
    got, lens, skipped, accepted = [[bonus[0]], [bonus[1]]], [len(p) for p in prompts], 0, 0
    rounds = 0
    while min(len(g) for g in got) < n_new:
        r = eng.round([0, 1], lens, [g[-1] for g in got], None, None, ["a", "b"])
        rounds += 1
        skipped += r.plan["skipped_draft"]
        accepted += sum(a - 1 for a in r.accept_lens) if not r.plan["skipped_draft"] else 0
        for b in range(2):
            got[b] += r.emitted[b]
            lens[b] += r.accept_lens[b]
    assert [g[:n_new] for g in got] == want
    assert len(calls) == rounds - skipped
    assert skipped == rounds // 2
    assert accepted > 0
