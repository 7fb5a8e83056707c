"""NextN's round shape per round (speculative/shapes.py): on synthetic cost surfaces the planner takes
the tree where rows are free, the chain where they are dear, no draft where drafting costs more than
it gives, explores the shapes it does not take, learns acceptances and draft times from the rounds,
and hands every rank the same tables; and rounds that change shape stay greedy-identical to plain
decoding in process (real NextN drafts, and the replay drafter's full / partial / zero
acceptance), and sampled ones follow the target's distribution."""

from __future__ import annotations

import json
import types

import pytest
import torch
from oracles.decode import nextn_setup, prefill

from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.speculative import shapes as S
from sglang_dsv4_ascend.speculative.cost import RoundCost
from sglang_dsv4_ascend.speculative.drafters import NextNDrafter, ReplayDrafter
from sglang_dsv4_ascend.speculative.engine import SpecEngine

TOPK, STEPS, DRAFT_TOKENS = 2, 3, 6


def _surface(per_row):
    """A round without its draft: 10 ms plus `per_row` seconds a verified row."""
    return RoundCost(0.01, [1, 16], [0.0, 0.0], [1, 400], [0.0, per_row * 399])


def _planner(per_row, chain_draft=0.002, tree_draft=0.004, accepted=(1.5, 2.2), rows_tree=9.0):
    pl = S.ShapePlanner(TOPK, STEPS, DRAFT_TOKENS)
    pl.seed(
        _surface(per_row), {"chain": [(1, chain_draft), (16, chain_draft)], "tree": [(1, tree_draft), (16, tree_draft)]}
    )
    pl.accepted["chain"], pl.accepted["tree"] = accepted
    pl.seen.update(chain=pl.first, tree=pl.first)  # the figures above stand for rounds seen
    pl.rows["tree"] = rows_tree
    return pl


def test_rows_free_tree_rows_dear_chain_draft_dear_none():
    """Chain: 2.5 tokens for 4 rows and 2 ms of drafting; tree: 3.2 tokens for 9 rows and 4 ms."""
    assert _planner(0.0).choose(4) == "tree"
    assert _planner(0.001).choose(4) == "chain"  # the tree's 5 rows more cost 20 ms at batch 4
    # drafting 60 ms a round: 2.5 tokens in 10 + 60 + rows ms do not beat 1 token in 10
    assert _planner(0.0, chain_draft=0.06, tree_draft=0.06).choose(4) == "plain"


def test_a_planner_blind_to_the_draft_stage_is_caught(monkeypatch):
    """The broken variant prices a round without its draft: it keeps drafting at any draft cost."""
    monkeypatch.setattr(S.ShapePlanner, "draft_seconds", lambda self, shape, R: 0.0)
    assert _planner(0.0, chain_draft=0.06, tree_draft=0.06).choose(4) != "plain"


def test_shapes_not_taken_are_explored():
    pl = _planner(0.0)
    picks = [pl.choose(4) for _ in range(64)]
    assert picks.count("tree") >= 60
    assert [i for i, s in enumerate(picks) if s == "chain"] and [i for i, s in enumerate(picks) if s == "plain"]
    gaps = [i for i, s in enumerate(picks) if s == "plain"]
    assert all(b - a >= pl.explore - 1 for a, b in zip(gaps, gaps[1:]))


def test_each_speculative_shape_is_seen_before_choosing():
    """Acceptance is unknown until a shape's rounds are seen: the first rounds take each in turn."""
    pl = S.ShapePlanner(TOPK, STEPS, DRAFT_TOKENS, first=1)
    pl.seed(_surface(0.0), {"chain": [(1, 0.002)], "tree": [(1, 0.004)]})
    assert pl.choose(1) == "chain"
    pl.learn("chain", 1, 4, [3], 0.02, 0.002)
    assert pl.choose(1) == "tree"
    pl.learn("tree", 1, 6, [1], 0.03, 0.004)
    assert pl.accepted == {"plain": 0.0, "chain": 2.0, "tree": 0.0}
    assert pl.choose(1) == "chain"


@pytest.mark.parametrize("first", [4, 1])
def test_one_unlucky_first_round_does_not_lock_the_tree_out(first):
    """At one request (rows nearly free) a tree whose first round accepted nothing but whose rounds
    accept 2 drafts on average against the chain's 1.5: after `first` rounds of each in turn the
    tree is chosen. Taking each shape once (the broken variant, as the planner did) prices the tree
    at its first round's zero and runs the chain until the next exploration: caught."""
    pl = S.ShapePlanner(TOPK, STEPS, DRAFT_TOKENS, first=first)
    pl.seed(_surface(0.0), {"chain": [(1, 0.002)], "tree": [(1, 0.002)]})
    tree, chain = iter([[1], [4], [3], [4]]), iter([[3], [2], [2], [3]])
    picks = []
    for _ in range(2 * first):
        shape = pl.choose(1)
        picks.append(shape)
        pl.learn(shape, 1, 6 if shape == "tree" else 4, next(tree if shape == "tree" else chain), 0.02, 0.002)
    assert sorted(picks) == ["chain"] * first + ["tree"] * first and picks[:2] == ["chain", "tree"]
    assert (pl.choose(1) == "tree") == (first == 4)


def test_rounds_teach_acceptance_rows_and_draft_times():
    """The tree accepts nothing and drafts slowly on this machine: fed such rounds the planner moves
    to the chain."""
    pl = _planner(0.0, chain_draft=0.002, tree_draft=0.002, accepted=(1.5, 2.5))
    assert pl.choose(4) == "tree"
    for _ in range(64):
        pl.learn("tree", 4, 40, [1, 1, 1, 1], 0.04, 0.02)
        pl.learn("chain", 4, 16, [3, 2, 3, 2], 0.02, 0.002)
    assert pl.accepted["tree"] < 0.01 and pl.rows["tree"] == pytest.approx(10.0, rel=0.01)
    assert pl.draft_seconds("tree", 4) == pytest.approx(0.02)
    assert pl.choose(4) == "chain"


def test_ranks_take_rank_zeros_tables():
    """Each rank times its own drafts; at every refit `agree` hands every rank rank 0's table."""
    seen = []

    def agree(x):
        seen.append(x)
        return {s: [(1, 0.5)] for s in x} if isinstance(x, dict) else x

    pl = S.ShapePlanner(TOPK, STEPS, DRAFT_TOKENS, agree=agree)
    pl.seed(_surface(0.0), {"chain": [(1, 0.001)], "tree": [(1, 0.001)]})
    for _ in range(pl.every):
        pl.learn("tree", 1, 9, [3], 0.01, 0.001)
    assert any(isinstance(x, dict) for x in seen) and pl.draft_seconds("tree", 1) == 0.5


def test_no_surface_keeps_the_configured_shape():
    assert S.ShapePlanner(TOPK, STEPS, DRAFT_TOKENS).choose(4) == "tree"
    assert S.ShapePlanner(1, STEPS, STEPS + 1).choose(4) == "chain"
    assert S.ShapePlanner(1, STEPS, STEPS + 1).shapes == ["plain", "chain"]


# -- rounds that change shape stay lossless -----------------------------------------------------
PROMPTS = (61, 7, 100, 30)
N_NEW = 16


class Cycle:
    """A shape planner that takes tree, chain, plain in turn (fixed before each round's draws)."""

    def __init__(self):
        self.real = S.ShapePlanner(TOPK, STEPS, DRAFT_TOKENS)
        self.geometry, self.n, self.last, self.taken = self.real.geometry, 0, {}, []

    def choose(self, R):
        shape = ("tree", "chain", "plain")[self.n % 3]
        self.n += 1
        self.last = {"shape": shape, "skipped_draft": shape == "plain"}
        return shape

    def learn(self, shape, R, rows, accept_lens, seconds, draft_seconds):
        self.taken.append((shape, rows, list(accept_lens)))


def _serve(trunk, nextn, drafter, prompts, guard=None):
    """Greedy rounds until every prompt has N_NEW tokens: shapes cycled (Cycle), or with `guard`
    (speculative/guard.py) the configured tree, drafting or not as the guard says. Returns
    (tokens per prompt, the rounds: (shape, rows, accept lens))."""
    host = types.SimpleNamespace(model=trunk, nextn=nextn, cfg=trunk.cfg)
    cache = trunk.make_cache(len(prompts), 160, DRAFT_TOKENS)
    eng = SpecEngine(host, cache, drafter, torch.Generator(), topk=TOPK, num_steps=STEPS, num_draft_tokens=DRAFT_TOKENS)
    eng.shapes, eng.guard, taken = (Cycle(), None, None) if guard is None else (None, guard, [])
    got = prefill(trunk, eng, prompts)
    lens = [len(p) for p in prompts]
    while min(map(len, got)) < N_NEW:
        live = [s for s in range(len(got)) if len(got[s]) < N_NEW]
        hist = [prompts[s] + got[s] for s in live]
        r = eng.round(live, [lens[s] for s in live], [got[s][-1] for s in live], None, hist, live)
        if guard is None:
            assert r.plan["shape"] == eng.shapes.taken[-1][0]
        else:
            shape = "plain" if r.plan.get("skipped_draft") else "tree"
            taken.append((shape, sum(t.n for t in r.trees), list(r.accept_lens), r.plan["guard"]))
        for s, e, a in zip(live, r.emitted, r.accept_lens):
            got[s] += e
            lens[s] += a
    return [g[:N_NEW] for g in got], eng.shapes.taken if guard is None else taken


@pytest.fixture(scope="module")
def tiny(dsv4_model, tiny_ckpt):
    return nextn_setup(dsv4_model, tiny_ckpt, PROMPTS, N_NEW, seed=5)


def test_changing_shapes_with_real_drafts_is_greedy_identical(tiny):
    trunk, nextn, prompts, want = tiny
    got, taken = _serve(trunk, nextn, NextNDrafter, prompts)
    assert got == want
    by = {s: [t for t in taken if t[0] == s] for s in ("tree", "chain", "plain")}
    assert all(by.values())
    # a chain round verifies steps + 1 rows a request, a plain one the anchor alone
    assert all(rows == len(acc) * (STEPS + 1) for _, rows, acc in by["chain"])
    assert all(rows == len(acc) and set(acc) == {1} for _, rows, acc in by["plain"])
    assert all(rows > len(acc) * (STEPS + 1) for _, rows, acc in by["tree"])


def test_changing_shapes_under_replayed_acceptance_is_greedy_identical(tiny, tmp_path):
    """Full, partial and zero acceptance (replay drafter) through tree, chain and plain rounds."""
    trunk, nextn, prompts, want = tiny
    path = tmp_path / "replay.json"
    modes = ["full", "partial:1", "zero", "sibling"]
    path.write_text(json.dumps({"sequences": [p + w for p, w in zip(prompts, want)], "modes": modes}))
    got, taken = _serve(trunk, nextn, lambda e: ReplayDrafter(e, str(path)), prompts)
    assert got == want
    full = [acc[0] for shape, _, acc in taken if shape != "plain" and len(acc) == len(prompts)]
    assert full and max(full) == STEPS + 1  # the full-acceptance request took whole paths


@pytest.fixture(scope="module")
def shipped_nextn():
    from sglang_dsv4_ascend import TINY_NEXTN_MODEL_PATH
    from sglang_dsv4_ascend.models.nextn import load_nextn_from_dir
    from sglang_dsv4_ascend.models.weights import load_model_from_dir

    trunk = load_model_from_dir(TINY_NEXTN_MODEL_PATH)
    return trunk, load_nextn_from_dir(TINY_NEXTN_MODEL_PATH, trunk.cfg)


@pytest.mark.parametrize("broken", [False, True])
def test_changing_shapes_sample_the_target_distribution(shipped_nextn, monkeypatch, broken):
    """Sampled rounds cycling tree / chain / no draft emit their first token distributed as the
    target's next-token distribution (chi-square over 20 bins of equal mass; 1200 draws: 12 rounds of
    100 requests with the same prompt and bonus, each in its own slot, every round restarting from
    that committed state, so a round gives 100 independent draws). The shipped trained model and
    its NextN draft, so that drafts are accepted in a good share of the drafting rounds (random
    weights accept almost none, and the test would prove nothing). The broken accept rule draws a
    tree's bonus, after every child was rejected, from the target row instead of the residual
    (the chain rule's remainder): caught."""
    from sglang_dsv4_ascend.speculative import accept as A
    from sglang_dsv4_ascend.speculative.accept import target_probs
    from tests.unit.test_dspark import _binned_chi2

    if broken:

        def rowwise_bonus(tree, probs, generator, draft_probs=None):
            path = [0]
            while True:
                kids = tree.children(path[-1])
                c = next((c for c in kids if A._uniform(generator) < float(probs[path[-1], tree.tokens[c]])), None)
                if c is None:
                    return path, A._draw(A._row(probs, path[-1]), generator)
                path.append(c)

        monkeypatch.setattr(A, "sample_accept", rowwise_bonus)
    trunk, nextn = shipped_nextn
    n, rounds, T = 100, 12, 0.7
    host = types.SimpleNamespace(model=trunk, nextn=nextn, cfg=trunk.cfg)
    cache = trunk.make_cache(n, 64, DRAFT_TOKENS)
    gen = torch.Generator().manual_seed(11)
    eng = SpecEngine(host, cache, NextNDrafter, gen, topk=TOPK, num_steps=STEPS, num_draft_tokens=DRAFT_TOKENS)
    eng.shapes = Cycle()
    prompt, anchor = [0, 1447, 2509, 409, 303, 397, 495, 353, 801], 335  # "The capital of France is"
    L = len(prompt)
    segs = [Segment(s, 0, L) for s in range(n)]
    aux = {}
    trunk(torch.tensor(prompt * n), torch.arange(L).repeat(n), segs, cache, aux=aux)
    shifted, finals = torch.tensor((prompt[1:] + [anchor]) * n), [(s, (s + 1) * L - 1) for s in range(n)]
    h = trunk(torch.tensor([anchor]), torch.tensor([L]), [Segment(0, L, 1)], cache, pending=[])
    p = target_probs(trunk.compute_logits(h), T, -1, 1.0, 0.0)[0]
    firsts, accepted, drafting = [], 0, 0
    for _ in range(rounds):
        eng.extend(segs, shifted, aux, None, finals)  # the draft state back at the prompt's end
        r = eng.round(list(range(n)), [L] * n, [anchor] * n, [dict(temperature=T)] * n, None, list(range(n)))
        firsts += [e[0] for e in r.emitted]
        if r.plan["shape"] != "plain":
            drafting += n
            accepted += sum(a > 1 for a in r.accept_lens)
    assert {s for s, _, _ in eng.shapes.taken} == {"tree", "chain", "plain"}
    assert accepted > 0.2 * drafting, (accepted, drafting)
    chi2, dof = _binned_chi2(torch.tensor(firsts), p)
    assert dof >= 10
    assert (chi2 < dof + 6 * (2 * dof) ** 0.5) != broken, (chi2, dof)
