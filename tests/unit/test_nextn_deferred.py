"""NextN's extend put off on plain rounds (speculative/drafters.NextNDrafter: `defers`): a plain
round stores no draft rows; they run as one batched step when the request drafts again, when it
holds DEFER_ROWS of them, or at a page boundary with prefix states on. The oracle is the same
engine extending on every round: the same drafts on every drafting round, the same draft state
once caught up, plain greedy decoding's tokens. A broken variant (put-off rows dropped instead of
run) is caught. Lossless under the guard and the round shapes with real drafts:
tests/unit/test_guard.py, tests/unit/test_shapes.py."""

import types

import pytest
import torch
from oracles.decode import nextn_setup, prefill

from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.speculative.drafters import NextNDrafter
from sglang_dsv4_ascend.speculative.engine import SpecEngine

PROMPTS = (40, 120, 9)  # the second crosses the 128-token page during the plain rounds
N_NEW = 30
PLAIN = (0, 1, 2, 3, 4, 5, 6, 8, 9, 10, 11, 12)  # the rounds that do not draft


class Schedule:
    """A guard that drafts on the rounds not in PLAIN (a plain stretch, one drafting round, ...)."""

    def __init__(self):
        self.round, self.last = -1, {}

    def draft(self, R, keys=None):
        self.round += 1
        return self.round not in PLAIN

    def learn(self, *a):
        pass


@pytest.fixture(scope="module")
def tiny(dsv4_model, tiny_ckpt):
    return nextn_setup(dsv4_model, tiny_ckpt, PROMPTS, N_NEW, seed=9)


def _engine(trunk, nextn, prefix=False):
    host = types.SimpleNamespace(model=trunk, nextn=nextn, cfg=trunk.cfg)
    cache = trunk.make_cache(len(PROMPTS), 200, 4)
    if prefix:
        cache.enable_prefix_states(8, 128)
    eng = SpecEngine(host, cache, NextNDrafter, torch.Generator(), topk=1, num_steps=3, num_draft_tokens=4)
    eng.guard = Schedule()
    return eng


def _serve(trunk, eng, prompts):
    """Prefill, then rounds until N_NEW tokens each -> (tokens, drafted chains per drafting round,
    the largest number of rows any request had put off)."""
    got = prefill(trunk, eng, prompts)
    lens, drafted, most = [len(p) for p in prompts], [], 0
    while min(map(len, got)) < N_NEW:
        live = [s for s in range(len(got)) if len(got[s]) < N_NEW]
        r = eng.round(live, [lens[s] for s in live], [got[s][-1] for s in live], None, None, live)
        if not r.plan.get("skipped_draft"):
            drafted.append([t.tokens for t in r.trees])
        for s, e, a in zip(live, r.emitted, r.accept_lens):
            got[s] += e
            lens[s] += a
        deferred = eng.drafter.deferred.values()
        most = max([most] + [d.end - d.start for d in deferred])
    return [g[:N_NEW] for g in got], drafted, most


def _state(drafter):
    drafter.catch_up()
    return [t.clone() for t in drafter.request_row_tensors()]


@pytest.mark.parametrize("prefix", [False, True])
def test_deferred_extends_draft_what_extending_every_round_drafts(tiny, prefix):
    trunk, nextn, prompts, want = tiny
    eager = _engine(trunk, nextn, prefix)
    eager.drafter.defers = False
    want_tokens, want_drafts, none = _serve(trunk, eager, prompts)
    eng = _engine(trunk, nextn, prefix)
    got_tokens, got_drafts, most = _serve(trunk, eng, prompts)
    assert want_tokens == want and got_tokens == want
    assert got_drafts == want_drafts and len(got_drafts) >= 3
    assert none == 0 and 0 < most < NextNDrafter.DEFER_ROWS
    for a, b in zip(_state(eng.drafter), _state(eager.drafter)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_dropping_the_deferred_rows_is_caught(tiny, monkeypatch):
    trunk, nextn, prompts, want = tiny
    eager = _engine(trunk, nextn)
    eager.drafter.defers = False
    _, want_drafts, _ = _serve(trunk, eager, prompts)
    monkeypatch.setattr(NextNDrafter, "catch_up", lambda self, slots=None: self.deferred.clear())
    got, got_drafts, _ = _serve(trunk, _engine(trunk, nextn), prompts)
    assert got == want and got_drafts != want_drafts  # lossless still: only the drafts suffer


def test_when_deferred_rows_run_or_are_dropped(tiny, monkeypatch):
    """At DEFER_ROWS rows; in the round whose row completes a page with prefix states on; before
    a drafting round of that request; dropped when the slot's next extend does not follow them (a
    new request in the slot) or a prefix hit restores the slot."""
    trunk, nextn, _, _ = tiny
    steps = []

    def record(self, segs, *a):
        steps.append([(s.slot, s.start, s.length) for s in segs])

    monkeypatch.setattr(NextNDrafter, "_extend", record)

    def plain(d, slot, start, n=1):
        for p in range(start, start + n):
            streams = torch.zeros(1, *d.root_streams.shape[1:])
            d.extend([Segment(slot, p, 1)], torch.tensor([7]), {"streams": streams}, None, [(0, 0)], defer=True)

    d = _engine(trunk, nextn).drafter
    plain(d, 0, 50, NextNDrafter.DEFER_ROWS - 1)
    assert not steps and d.deferred[0].end == 50 + NextNDrafter.DEFER_ROWS - 1
    plain(d, 0, 50 + NextNDrafter.DEFER_ROWS - 1)
    assert steps.pop() == [(0, 50, NextNDrafter.DEFER_ROWS)] and not d.deferred
    plain(d, 1, 120, 7)  # no prefix states: a page boundary is nothing special
    assert not steps
    p = _engine(trunk, nextn, prefix=True).drafter
    plain(p, 1, 120, 7)  # rows 120..126
    assert not steps
    plain(p, 1, 127)  # completes the page: run now, as the target's state there is saved now
    assert steps.pop() == [(1, 120, 8)] and not p.deferred
    plain(p, 1, 128, 3)
    p.catch_up([1, 2])  # what draft() does for the drafting requests first
    assert steps.pop() == [(1, 128, 3)] and not p.deferred
    plain(p, 2, 60, 3)
    streams = torch.zeros(4, *p.root_streams.shape[1:])
    p.extend([Segment(2, 0, 4)], torch.arange(4), {"streams": streams}, None, [(0, 3)])  # a new prompt
    assert steps.pop() == [(2, 0, 4)] and not p.deferred
    plain(p, 2, 63, 2)
    p.extend([Segment(2, 65, 1)], torch.arange(1), {"streams": streams[:1]}, None, [(0, 0)])  # mixed step
    assert steps.pop() == [(2, 65, 1)] and steps.pop() == [(2, 63, 2)]
    plain(p, 0, 10, 2)  # then a radix hit in the slot: its state comes from the store
    monkeypatch.setattr(p.draft_cache, "restore_prefix", lambda slot, length: None)
    p.restore(0, 128)
    assert not p.deferred
