"""The server's speculative stage statistics (speculative/stats.StageStats, what /get_server_info and
the decode log show) against their definitions, recomputed here from the rounds themselves:
committed tokens are the accepted path lengths (bonus included); draft position k was tested in a
request-round when drafts 1..k-1 were accepted and the node accepted last had a child to test;
its acceptance is the share of those rounds that accepted draft k. Random trees, chains and
accepted paths (hypothesis); a statistics class that shifts positions by one, or that counts a
position as tested because some other branch of the tree reaches that deep, is caught."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_dsv4_ascend.speculative.stats import StageStats
from sglang_dsv4_ascend.speculative.tree import DraftTree


@st.composite
def request_round(draw):
    """(tree, accepted path): a random tree (parents before children) and a root-to-node path."""
    n = draw(st.integers(1, 9))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tree = DraftTree(list(range(n)), parents)
    path = [0]
    while tree.children(path[-1]) and draw(st.booleans()):
        path.append(draw(st.sampled_from(tree.children(path[-1]))))
    return tree, path


rounds = st.lists(st.lists(request_round(), min_size=1, max_size=4), min_size=1, max_size=6)


def _result(reqs, skipped=False):
    return SimpleNamespace(
        trees=[t for t, _ in reqs],
        paths=[p for _, p in reqs],
        drafted=[t.n - 1 for t, _ in reqs],
        timings={"draft": 0.001, "verify": 0.002},
        plan={"skipped_draft": skipped},
    )


def oracle(all_rounds):
    tested, accepted, committed = {}, {}, 0
    for reqs in all_rounds:
        for tree, path in reqs:
            committed += len(path)
            for k in range(1, tree.n):  # draft position k (1-based)
                if len(path) >= k and tree.children(path[k - 1]):
                    tested[k] = tested.get(k, 0) + 1
                    accepted[k] = accepted.get(k, 0) + (len(path) > k)
    return committed, {k: accepted[k] / tested[k] for k in tested}


def _check(cls, all_rounds):
    stats = cls()
    for i, reqs in enumerate(all_rounds):
        stats.add(_result(reqs, skipped=i % 2 == 1))
    snap = stats.snapshot()
    committed, by_pos = oracle(all_rounds)
    assert snap["committed_tokens"] == committed
    assert snap["rounds"] == len(all_rounds) and snap["skipped_draft_rounds"] == len(all_rounds) // 2
    assert snap["request_rounds"] == sum(map(len, all_rounds))
    assert snap["verified_draft_tokens"] == sum(t.n - 1 for reqs in all_rounds for t, _ in reqs)
    got = {k: a for k, a in enumerate(snap["acceptance_by_position"], 1) if a is not None}
    assert got == {k: round(a, 4) for k, a in by_pos.items()}
    rr = sum(map(len, all_rounds))
    assert snap["accept_length"] == round(committed / rr, 4)
    # a plain step (a tree of its root alone) neither drafts nor dilutes the drafting acceptance
    drafting = [(t, p) for reqs in all_rounds for t, p in reqs if t.n > 1]
    assert snap["drafting_request_rounds"] == len(drafting)
    assert snap["accepted_drafts"] == sum(len(p) - 1 for _, p in drafting)


@settings(max_examples=150, deadline=None)
@given(rounds)
def test_stage_statistics_follow_their_definitions(all_rounds):
    _check(StageStats, all_rounds)


class Shifted(StageStats):
    """Broken: acceptance at position k counted from the rounds that tested position k + 1."""

    def snapshot(self):
        snap = super().snapshot()
        snap["acceptance_by_position"] = snap["acceptance_by_position"][1:] + [None]
        return snap


class DeepestBranch(StageStats):
    """Broken: position k counted as tested whenever the tree is k deep somewhere, though the node
    accepted last is a leaf (the statistics once did this for trees)."""

    def add(self, res):
        super().add(SimpleNamespace(**{**vars(res), "trees": [], "paths": [], "drafted": []}))
        for tree, path in zip(res.trees, res.paths):
            self.request_rounds += 1
            self.verified += tree.n - 1
            self.committed += len(path)
            depth = max(tree.depth()) if tree.n > 1 else 0
            while len(self.verified_at) < depth:
                self.verified_at.append(0)
                self.accepted_at.append(0)
            for k in range(min(depth, len(path))):
                self.verified_at[k] += 1
            for k in range(len(path) - 1):
                self.accepted_at[k] += 1


# a chain accepting 1 of 2 drafts, then both; a tree whose accepted node (1) is a leaf while node 2
# has a child: draft 2 was tested twice and accepted once (0.5), not three times (0.33)
CHAIN = (DraftTree([5, 6, 7], [-1, 0, 1]), [0, 1])
FULL = (DraftTree([5, 6, 7], [-1, 0, 1]), [0, 1, 2])
TREE = (DraftTree([5, 6, 7, 8], [-1, 0, 0, 2]), [0, 1])
ROUNDS = [[CHAIN, TREE], [FULL]]


def test_shifted_or_deepest_branch_statistics_are_caught():
    _check(StageStats, ROUNDS)
    assert oracle(ROUNDS) == (7, {1: 1.0, 2: 0.5})
    for broken in (Shifted, DeepestBranch):
        with pytest.raises(AssertionError):
            _check(broken, ROUNDS)
