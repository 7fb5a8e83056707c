"""The speculation guard (speculative/guard.py): per batch-size class, drafting only where rounds
that draft measured more tokens per request-second than plain decode steps. Synthetic machines
drive it (what a round costs and emits is set by the test, never taken from the code); a real
engine shows its plain rounds stay greedy-identical."""

from __future__ import annotations

import json
import statistics
from collections import deque

import pytest

from sglang_dsv4_ascend.speculative.guard import Guard, batch_class
from tests.unit import test_shapes
from tests.unit.test_shapes import _serve


def _drive(guard, rounds, R, tokens, seconds):
    """`rounds` rounds of R requests; a drafting round emits tokens(R) in seconds(R, True), a
    plain one R tokens in seconds(R, False). Returns the choices (True: drafted)."""
    taken = []
    for i in range(rounds):
        r = R(i) if callable(R) else R
        d = guard.draft(r)
        guard.learn(r, d, tokens(r) if d else r, seconds(r, d, i))
        taken.append(d)
    return taken


def test_batch_classes_step_about_sqrt_two():
    assert [batch_class(R) for R in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 16, 17, 1024, 1025)] == [
        1, 2, 3, 4, 6, 6, 8, 8, 12, 16, 16, 24, 1024, 2048,
    ]  # fmt: skip


def test_drafting_that_loses_runs_plain_and_is_explored():
    """Drafting emits 2 tokens a request in 3x a plain step's time: after `first` rounds each way,
    plain, with a drafting round every `explore` rounds of the class."""
    g = Guard(first=4, explore=32)
    taken = _drive(g, 260, 16, lambda R: 2 * R, lambda R, d, i: 0.03 if d else 0.01)
    assert taken[:8] == [True] * 4 + [False] * 4
    assert [i for i, d in enumerate(taken) if d and i >= 8] == [32, 64, 96, 128, 160, 192, 224, 256]
    assert g.describe()["R<=16"]["choice"] == "plain"


def test_drafting_that_wins_by_far_never_steps_plain_again():
    g = Guard(first=4, explore=32, sure=1.25)
    taken = _drive(g, 200, 1, lambda R: 3 * R, lambda R, d, i: 0.012 if d else 0.01)
    assert taken[:8] == [True] * 4 + [False] * 4
    assert all(taken[8:])


def test_a_startup_timing_spares_plain_rounds_only_for_a_sure_win():
    """A plain step timed at startup at 10 ms: drafting at 3 tokens in 12 ms (2.5x) skips the plain
    rounds that learn, checked by one every `explore` rounds until `first` are measured (then, the
    win confirmed, never again); at 2 tokens in 18 ms (1.11x, within `sure`) it measures plain
    steps first."""
    plain = [(1, 0.01), (16, 0.01)]
    far = _drive(Guard(plain=plain), 300, 4, lambda R: 3 * R, lambda R, d, i: 0.012 if d else 0.01)
    assert [i for i, d in enumerate(far) if not d] == [32, 64, 96, 128]
    near = _drive(Guard(plain=plain), 100, 4, lambda R: 2 * R, lambda R, d, i: 0.018 if d else 0.01)
    assert near[:8] == [True] * 4 + [False] * 4


def test_a_sure_win_that_fades_is_measured_against_plain_steps():
    """Drafting wins by far against the startup timing, then its rounds get 3x dearer (acceptance
    gone, say): the next refit has no sure win, so plain steps are measured and taken."""
    g = Guard(plain=[(1, 0.01)], keep=8, every=8)
    taken = _drive(g, 120, 2, lambda R: 3 * R, lambda R, d, i: (0.012 if i < 40 else 0.05) if d else 0.01)
    assert [i for i, d in enumerate(taken[:40]) if not d] == [32]  # the startup timing's win, checked
    assert sum(taken[80:]) <= 40 // g.explore + 1  # exploring only


def test_a_busy_startup_timing_does_not_make_a_sure_win():
    """Measured while the machine was busy, the startup timing read 40 ms at one request and 17 ms
    at two (a CI run): drafting that accepts nothing, 25 ms a round, then looked 1.6x a plain step
    and plain steps were never measured. The fastest timing at R or more requests stands for R."""
    g = Guard(plain=[(1, 0.040), (2, 0.017), (4, 0.015)])
    taken = _drive(g, 40, 1, lambda R: R, lambda R, d, i: 0.025 if d else 0.015)
    assert taken[:8] == [True] * 4 + [False] * 4
    assert [i for i, d in enumerate(taken) if d and i >= 8] == [32]  # explored only


def test_a_startup_win_that_plain_rounds_refute_is_dropped():
    """The startup timing (40 ms, busy) calls drafting at 25 ms a sure win; the plain steps that
    check it measure 15 ms, and once `first` are measured plain wins."""
    g = Guard(plain=[(1, 0.040)])
    taken = _drive(g, 200, 1, lambda R: R, lambda R, d, i: 0.025 if d else 0.015)
    assert all(taken[:32]) and not any(taken[130:160])


def test_drafting_that_wins_narrowly_keeps_plain_explored():
    """Within the `sure` margin a plain step is taken now and then: the figure it is compared with
    can move. At 1.11x a plain step loses a tenth of a round; at 1 % of the rounds' time spent
    exploring, it is taken every 10th round."""
    g = Guard(first=4, explore=32, sure=1.25)
    taken = _drive(g, 200, 8, lambda R: 2 * R, lambda R, d, i: 0.018 if d else 0.01)  # 1.11x
    assert [i for i, d in enumerate(taken) if not d and i >= 8] == list(range(10, 200, 10))


def test_the_choice_follows_a_change_of_cost():
    """Drafting wins, then (longer contexts, say) loses: the plain steps it explores see it."""
    g = Guard(first=4, explore=8, keep=8, sure=10.0)
    taken = _drive(g, 240, 4, lambda R: 2 * R, lambda R, d, i: (0.015 if i < 80 else 0.04) if d else 0.01)
    assert sum(taken[40:80]) == 40 - 40 // 8
    assert sum(taken[200:]) <= 40 // 8


def test_a_narrow_loser_is_explored_more_often_than_a_far_one():
    """Drafting at 0.9x a plain step loses a tenth of a round when explored: every 10th round; at
    0.5x, every `explore`-th (32)."""
    narrow = _drive(Guard(), 200, 4, lambda R: 1.8 * R, lambda R, d, i: 0.02 if d else 0.01)
    far = _drive(Guard(), 200, 4, lambda R: R, lambda R, d, i: 0.02 if d else 0.01)
    assert [i for i, d in enumerate(narrow) if d and i >= 8] == list(range(10, 200, 10))
    assert [i for i, d in enumerate(far) if d and i >= 8] == [32, 64, 96, 128, 160, 192]


class _NoRegimeChange(Guard):
    """Broken on purpose: the loser's explored rounds only ever join its median of `keep`."""

    def _regime_change(self, c):
        pass


def _acceptance_jumps(i):
    """Drafting accepts 1.8 tokens a round (0.9x plain) for 100 rounds, then 3 (1.5x): the next
    prompt, say."""
    return 1.8 if i < 100 else 3.0


@pytest.mark.parametrize("kind", [Guard, _NoRegimeChange])
def test_a_change_of_acceptance_is_followed_within_a_request(kind):
    """Served at one request with graphs, the first prompt's drafts won 0.9x and the guard then
    ran 229 plain rounds while the next prompts accepted 3 tokens a round. Four explored rounds
    that all beat plain now make drafting's figure: drafting within 50 rounds of the change."""
    g = kind()
    taken = []
    for i in range(300):
        d = g.draft(1)
        g.learn(1, d, _acceptance_jumps(i) if d else 1, 0.02 if d else 0.01)
        taken.append(d)
    assert sum(taken[20:100]) <= 8  # plain before the change (explored every 10th round)
    settled = next(i for i in range(300, 0, -1) if not taken[i - 1])  # drafting every round from here
    # the premise, for the variant: half of the median's 16 rounds must be new, 8 explorations
    assert (settled <= 150) == (kind is Guard), settled


class _OneBeats(Guard):
    """Broken on purpose: one explored round that beats the winner's median is a change."""

    def _regime_change(self, c):
        kind, rates = self.explored.get(c, (None, ()))
        if rates:
            self.explored[c] = (kind, deque(list(rates)[-1:] * self.first, maxlen=self.first))
        super()._regime_change(c)


@pytest.mark.parametrize("kind", [Guard, _OneBeats])
def test_explored_rounds_that_beat_plain_now_and_then_do_not_change_the_choice(kind):
    """Drafting at 0.9x, one explored round in three descheduled plain's way (1.5x): never four in
    a row, and the median stays 0.9x: plain all along, explored every 10th round."""
    g = kind()
    taken = _drive(
        g, 400, 4, lambda R: 4.0 * R, lambda R, d, i: (0.0267 if (i // 10) % 3 == 2 else 0.0444) if d else 0.01
    )
    explored = [i for i, d in enumerate(taken) if d and i >= 8]
    assert (explored == list(range(10, 400, 10))) == (kind is Guard)


def test_ranks_agree_when_one_rank_sees_the_change():
    """Rank 0's drafts jump to 1.5x plain, rank 1's stay at 0.9x: rank 0 finds the change, both
    take its table, and both refit at the same rounds (the agreement is a collective)."""
    box, calls = {}, [0, 0]

    def agree(rank):
        def f(t):
            calls[rank] += 1
            return box.setdefault("t", t) if rank == 0 else box.pop("t")

        return f

    g0, g1 = Guard(agree=agree(0)), Guard(agree=agree(1))
    out = ([], [])
    for i in range(300):
        for rank, g in enumerate((g0, g1)):
            d = g.draft(1, [(1, f"rid{i // 64}")])  # a new request every 64 rounds
            accepted = _acceptance_jumps(i) if rank == 0 else 1.8
            g.learn(1, d, accepted if d else 1, 0.02 if d else 0.01)
            out[rank].append(d)
        box.pop("t", None)
    assert out[0] == out[1] and all(out[0][150:])
    assert calls[0] == calls[1]


def _requests(guard, n_requests, rounds_each, accepted, keys=True):
    """One request at a time, `rounds_each` rounds each: request q's drafting round emits
    accepted(q) tokens in 20 ms, a plain one 1 token in 10 ms. Returns the choices per request."""
    out = []
    for q in range(n_requests):
        taken = []
        for _ in range(rounds_each):
            d = guard.draft(1, [(1, f"rid{q}")] if keys else None)
            guard.learn(1, d, accepted(q) if d else 1, 0.02 if d else 0.01)
            taken.append(d)
        out.append(taken)
    return out


def test_a_new_request_gets_its_own_drafting_figure():
    """At one request, the first request's drafts are never accepted (plain wins 2x), the next ones'
    3 tokens a round (drafting 1.5x): each new request drafts its first 4 rounds, and from the
    second request on drafting wins from its 5th round. A bad request after good ones keeps
    drafting until its own rounds pull drafting's median down. Without the requests' ids
    (the premise) the second request runs plain throughout but for explored rounds."""
    by_request = _requests(Guard(), 5, 64, lambda q: 1.0 if q in (0, 3) else 3.0)
    assert sum(by_request[0][8:]) <= 3  # plain after learning, explored every 32nd round
    assert all(by_request[1]) and all(by_request[2])
    assert all(by_request[3][:8]) and sum(by_request[3][24:]) <= 2 and all(by_request[4])
    blind = _requests(Guard(), 2, 64, lambda q: 1.0 if q == 0 else 3.0, keys=False)
    assert sum(blind[1]) <= 3


def test_new_requests_that_do_not_pay_cost_four_rounds_each():
    """Every request's drafts are never accepted: each new one drafts 4 rounds and goes plain."""
    by_request = _requests(Guard(), 5, 64, lambda q: 1.0)
    for q, taken in enumerate(by_request[1:], 1):
        assert taken[:4] == [True] * 4 and sum(taken[4:]) <= 2, (q, taken)


def test_larger_batches_do_not_relearn_on_turnover():
    """At 8 requests (above `turnover_max`) a batch of all-new requests every round changes
    nothing: drafting that loses is explored every 32nd round only."""
    g = Guard()
    taken = []
    for i in range(200):
        keys = [(s, f"rid{i}-{s}") for s in range(8)]
        d = g.draft(8, keys)
        g.learn(8, d, 8 if d else 8, 0.02 if d else 0.01)
        taken.append(d)
    assert [i for i, d in enumerate(taken) if d and i >= 8] == [32, 64, 96, 128, 160, 192]


class _Mean(Guard):
    """Broken on purpose: compares mean rates, so one descheduled round decides."""

    def ratio(self, c):
        seen = self.rates[c]
        if min(len(seen[True]), len(seen[False])) < self.first:
            return None
        return statistics.mean(r for _, r in seen[True]) / statistics.mean(r for _, r in seen[False])


@pytest.mark.parametrize("kind", [Guard, _Mean])
def test_one_slow_round_does_not_decide(kind):
    """Drafting is 1.5x faster, but every 8th plain round is descheduled to 1/50 of its rate (a
    rate read 50x high would be the mirror case: a plain round 50x fast). Medians ignore it."""
    g = kind(first=4, explore=32)

    def seconds(R, d, i):
        return 0.02 if d else (0.0002 if i % 8 == 5 else 0.01)

    taken = _drive(g, 120, 4, lambda R: 3 * R, seconds)
    assert (sum(taken[8:]) > 100) == (kind is Guard), sum(taken[8:])


def test_classes_decide_apart():
    """Alone drafting pays, at 16 requests it does not: rounds alternating between the two batch
    sizes learn each class on its own."""
    g = Guard(first=4, explore=1000, explore_min=1000)  # never explored

    def seconds(R, d, i):
        return (0.012 if R == 1 else 0.04) if d else 0.01

    taken = _drive(g, 200, lambda i: 1 if i % 2 else 16, lambda R: 2 * R, seconds)
    alone, busy = taken[1::2][10:], taken[0::2][10:]
    assert all(alone) and not any(busy)


def test_ranks_take_rank_zeros_winners():
    """Two ranks measure opposite timings; each refit takes rank 0's table, so they choose alike.
    Without the agreement they would not (checked: the test's premise)."""

    def run(agree_pair):
        box = {}
        g0 = Guard(first=4, every=8, agree=(lambda t: box.setdefault("t", t)) if agree_pair else None)
        g1 = Guard(first=4, every=8, agree=(lambda t: box.pop("t")) if agree_pair else None)
        out = ([], [])
        for _ in range(120):
            for rank, (g, dear) in enumerate(((g0, 0.04), (g1, 0.012))):
                d = g.draft(8)
                g.learn(8, d, 16 if d else 8, dear if d else 0.01)
                out[rank].append(d)
            box.pop("t", None)
        return out

    a, b = run(True)
    assert a == b and not all(a[8:])
    a, b = run(False)
    assert a != b


def test_bad_rounds_are_ignored():
    g = Guard()
    g.learn(0, True, 0, 0.01)
    g.learn(4, True, 8, 0.0)
    assert g.rates == {}


# --- a real engine: rounds the guard makes plain are ordinary rounds -------------------------

tiny = test_shapes.tiny  # the fixture: a tiny model, its NextN block, prompts, their greedy tokens


class _Clocked(Guard):
    """The real guard, fed a synthetic clock: a drafting round costs 3x a plain one."""

    def learn(self, R, drafted, tokens, seconds):
        super().learn(R, drafted, tokens, 0.03 if drafted else 0.01)


def test_plain_rounds_are_greedy_identical(tiny, tmp_path):
    """Zero acceptance (replay drafter): the guard learns drafting, then plain, then steps plain,
    exploring drafting every 5th round; the output equals plain greedy decoding token for token
    and a plain round verifies each request's anchor row only."""
    from sglang_dsv4_ascend.speculative.drafters import ReplayDrafter

    trunk, nextn, prompts, want = tiny
    path = tmp_path / "replay.json"
    path.write_text(json.dumps({"sequences": [p + w for p, w in zip(prompts, want)], "mode": "zero"}))
    got, taken = _serve(trunk, nextn, lambda e: ReplayDrafter(e, str(path)), prompts, guard=_Clocked(explore=5))
    assert got == want
    reasons = [t[3] for t in taken]
    assert reasons[:8] == ["learning drafting"] * 4 + ["learning plain"] * 4
    assert set(reasons[8:]) == {"plain", "exploring drafting"}, reasons
    assert all(rows == len(acc) for shape, rows, acc, _ in taken if shape == "plain")
    assert all(rows > len(acc) for shape, rows, acc, _ in taken if shape == "tree")


def test_plain_rounds_with_real_drafts_are_greedy_identical(tiny):
    from sglang_dsv4_ascend.speculative.drafters import NextNDrafter

    trunk, nextn, prompts, want = tiny
    got, taken = _serve(trunk, nextn, NextNDrafter, prompts, guard=_Clocked(first=2, explore=3))
    assert got == want
    assert {t[0] for t in taken} == {"plain", "tree"}


def test_the_plain_timing_is_read_from_a_startup_seed_without_timing_twice(monkeypatch):
    """DSpark adaptive's cost seed (planner.measure_cost with a drafter) times one-row forwards
    anyway: their target time alone, the draft's apart, is the guard's plain step, read from the
    seed with no forward of its own. Without a seed (or one that timed no one-row forward) the
    guard times them itself. A synthetic clock: a forward costs 10 ms a row, a draft 1 s."""
    from types import SimpleNamespace

    import torch

    from sglang_dsv4_ascend.speculative import planner as P
    from sglang_dsv4_ascend.speculative.guard import plain_round_seconds

    calls, layers = [], set()

    class Trunk:
        def __call__(self, ids, pos, segs, cache, pending=None, aux=None):
            calls.append(("forward", ids.shape[0]))
            layers.add(aux["layer_ids"])
            return ids.shape[0]

        def compute_logits(self, rows):
            calls.append(("head", rows))

    trunk = Trunk()
    drafter = SimpleNamespace(draft=lambda slots, *a: calls.append(("draft", len(slots))), layer_ids=(10, 11))

    def clock(fn):  # best_of on the synthetic clock: the seconds of the call it runs
        n = len(calls)
        fn()
        kind, rows = calls[n]
        return 1.0 if kind == "draft" else 0.01 * rows

    monkeypatch.setattr(P, "best_of", clock)
    cache = SimpleNamespace(max_context_len=1000, device=torch.device("cpu"))
    seed = P.measure_cost(trunk, cache, 4, max_requests=4, budget_s=60.0, drafter=drafter)
    assert sorted(seed.plain_points) == [(1, 0.01), (2, 0.02), (4, 0.04)]
    # every timed forward is a verify stage: the draft's target layers kept, the head over its
    # rows right after it
    assert layers == {(10, 11)}
    assert all(calls[i + 1] == ("head", rows) for i, (kind, rows) in enumerate(calls) if kind == "forward")
    # the surface's own one-row points carry the draft: read as a plain step they would be 100x off
    assert sorted((R, t) for R, rows, t in seed.points if rows == R) == [(1, 1.01), (2, 1.02), (4, 1.04)]
    n = len(calls)
    got, source = plain_round_seconds(trunk, cache, 4, seed=seed)
    assert sorted(got) == [(1, 0.01), (2, 0.02), (4, 0.04)] and source == "read from the startup cost seed"
    assert len(calls) == n  # nothing timed twice
    # a seed that timed no one-row forward, or not every batch size (its budget ran out), or
    # none: the guard times them itself
    for other in (None, SimpleNamespace(plain_points=[]), SimpleNamespace(plain_points=[(1, 0.5), (4, 0.5)])):
        got, source = plain_round_seconds(trunk, cache, 4, seed=other)
        assert sorted(got) == [(1, 0.01), (2, 0.02), (4, 0.04)] and source == "timed" and len(calls) > n
        n = len(calls)


class _Recording(_Clocked):
    def __init__(self, **kw):
        super().__init__(**kw)
        self.keys = []

    def draft(self, R, keys=None):
        self.keys.append(keys)
        return super().draft(R, keys)


def test_the_engine_names_each_rounds_requests(tiny):
    """The engine hands the guard each round's requests as (slot, request id) (the worker's ids are
    SGLang's rids): what tells a new request from one that has drafted."""
    from sglang_dsv4_ascend.speculative.drafters import NextNDrafter

    trunk, nextn, prompts, want = tiny
    guard = _Recording(first=2, explore=3)
    got, taken = _serve(trunk, nextn, NextNDrafter, prompts, guard=guard)
    assert got == want and len(guard.keys) == len(taken)
    assert all(keys and all(slot == rid for slot, rid in keys) for keys in guard.keys)
    assert guard.keys[0] == [(s, s) for s in range(len(prompts))]
