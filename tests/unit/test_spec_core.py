"""Speculative core (sglang_dsv4_ascend/speculative: tree.py, accept.py) against the independent
oracles in tests/oracles/spec_oracle.py.

* Structure (EAGLE tree construction, DraftTree queries, greedy acceptance, the sampler transform)
  must equal the oracle exactly; each check is paired with a deliberately broken variant that the
  same comparison must catch, which proves the generated cases can tell right from wrong.
* Rejection sampling must be lossless: at a fixed seed, the empirical distribution of the first
  emitted token and of the first two jointly must pass a chi-square test against the exact
  sequential-sampling distribution, with enough draws to detect a 2 % mass shift, while biased
  variants of the rule fail the same test by a wide margin.
"""

from __future__ import annotations

import ast
import importlib.util
import random
from pathlib import Path
from typing import Optional

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from oracles import spec_oracle as O
from scipy.stats import chi2, chisquare, ncx2

from sglang_dsv4_ascend.speculative import tree as tree_mod
from sglang_dsv4_ascend.speculative.accept import (
    accept_batch,
    greedy_accept,
    sample_accept,
    target_probs,
)
from sglang_dsv4_ascend.speculative.tree import DraftTree, TreeBuilder, topk_stable

HYP = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TOP_K_ALL = 1 << 30  # sglang.srt.sampling.sampling_params.TOP_K_ALL


# ---------------------------------------------------------------------------------------------
# Helpers


def draft_row_fn(seed: int, V: int, ties: bool):
    """A deterministic stand-in drafter: context token path -> V binary32 probabilities. With ties,
    weights are small integers, so equal probabilities (and zeros) are common."""

    def row(path):
        rng = random.Random(f"{seed}:{tuple(path)}")
        w = [rng.randint(0, 3) if ties else rng.random() for _ in range(V)]
        s = sum(w) or 1.0
        return [O.f32(x / s) for x in w]

    return row


def max_nodes(topk: int, steps: int) -> int:
    return 1 + topk + (steps - 1) * topk * topk


def run_builder(builder_cls, root, topk, steps, row, N):
    """Drive a builder the way the worker does: one drafter call per step, rows in leaf order."""
    b = builder_cls(root, topk)
    leaves = b.step(torch.tensor([row(())]))
    for _ in range(1, steps):
        leaves = b.step(torch.tensor([row(b.tokens_of(c)) for c in leaves]))
    tree, cands = b.finish(N)
    return b, tree, cands


def builder_case(seed: int):
    """A seeded (topk, steps, V, ties, N) case for the broken-variant searches."""
    rng = random.Random(seed)
    topk, steps = rng.randint(1, 4), rng.randint(1, 4)
    V = rng.randint(topk, 10)
    ties = rng.random() < 0.5
    return topk, steps, V, ties, rng.randint(2, max_nodes(topk, steps))


def matches_oracle(builder_cls, seed) -> bool:
    topk, steps, V, ties, N = builder_case(seed)
    row = draft_row_fn(seed, V, ties)
    _, tree, cands = run_builder(builder_cls, 5, topk, steps, row, N)
    return (list(tree.tokens), list(tree.parents), cands) == O.eagle_tree(5, topk, steps, row, N)


@st.composite
def draft_trees(draw, max_n=12, vocab=4):
    n = draw(st.integers(1, max_n))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    tokens = [draw(st.integers(0, vocab - 1)) for _ in range(n)]
    return DraftTree(tuple(tokens), tuple(parents))


def random_tree(rng: random.Random, max_n=12, vocab=4) -> DraftTree:
    n = rng.randint(1, max_n)
    return DraftTree(
        tuple(rng.randrange(vocab) for _ in range(n)),
        tuple([-1] + [rng.randrange(i) for i in range(1, n)]),
    )


def deepest_leaf(tree: DraftTree) -> int:
    d = tree.depth()
    return max(tree.leaves(), key=lambda i: (d[i], -i))


# ---------------------------------------------------------------------------------------------
# DraftTree


@HYP
@given(draft_trees(), st.integers(0, 100))
def test_draft_tree_queries_match_oracle(tree, L):
    par = list(tree.parents)
    assert tree.n == len(par)
    assert list(tree.depth()) == O.depths(par)
    assert tree.positions(L) == [L + d for d in O.depths(par)]
    assert tree.leaves() == O.leaves(par)
    assert tree.is_chain == (len(O.leaves(par)) == 1)  # a chain: one leaf
    for i in range(tree.n):
        assert tree.children(i) == [j for j in range(tree.n) if par[j] == i]
        assert tree.path(i) == O.root_path(par, i)
    assert tree.paths() == [O.root_path(par, leaf) for leaf in O.leaves(par)]
    assert tree.ancestor_mask().tolist() == O.ancestor_matrix(par)
    assert tree.ancestor_mask().dtype == torch.bool


def test_draft_tree_chain_and_coercion():
    c = DraftTree.chain([4, 5, 6])
    assert c.parents == (-1, 0, 1) and c.tokens == (4, 5, 6)
    assert c.leaves() == [2] and c.paths() == [[0, 1, 2]]
    single = DraftTree.chain([9])
    assert single.n == 1 and single.leaves() == [0] and single.ancestor_mask().tolist() == [[True]]
    t = DraftTree([1, 2], [-1, 0])  # lists are stored as tuples: the tree stays hashable
    assert t.tokens == (1, 2) and hash(t) == hash(DraftTree((1, 2), (-1, 0)))


@pytest.mark.parametrize(
    "tokens, parents, what",
    [
        ((), (), "at least the root"),
        ((1, 2), (-1,), "parents"),
        ((1, 2), (0, 0), "root must have parent -1"),
        ((1, 2, 3), (-1, 0, 2), "node 2 has parent 2"),
        ((1, 2, 3), (-1, 2, 0), "node 1 has parent 2"),
        ((1, 2), (-1, -1), "node 1 has parent -1"),
        ((1, -2), (-1, 0), "negative token"),
    ],
)
def test_draft_tree_rejects_invalid(tokens, parents, what):
    with pytest.raises(ValueError, match=what):
        DraftTree(tokens, parents)


def broken_ancestor_mask_sibling_visible(tree: DraftTree) -> torch.Tensor:
    """Bug: siblings see each other (a "same depth" mask instead of an ancestor mask)."""
    mask = tree.ancestor_mask().clone()
    for i in range(1, tree.n):
        for j in tree.children(tree.parents[i]):
            mask[i, j] = True
    return mask


def test_broken_ancestor_mask_is_caught():
    rng = random.Random(0)
    cases = [random_tree(rng) for _ in range(50)]
    assert all(t.ancestor_mask().tolist() == O.ancestor_matrix(list(t.parents)) for t in cases)
    assert any(broken_ancestor_mask_sibling_visible(t).tolist() != O.ancestor_matrix(list(t.parents)) for t in cases)


# ---------------------------------------------------------------------------------------------
# EAGLE tree construction


def test_topk_stable_tie_rule():
    x = torch.tensor([[0.1, 0.3, 0.3, 0.0, 0.3], [0.5, 0.2, 0.2, 0.2, 0.1]])
    vals, idx = topk_stable(x, 2)
    assert idx.tolist() == [[1, 2], [0, 1]]
    torch.testing.assert_close(vals, torch.tensor([[0.3, 0.3], [0.5, 0.2]]))
    _, idx = topk_stable(torch.zeros(7), 3)  # 1-D, all tied
    assert idx.tolist() == [0, 1, 2]


@HYP
@given(
    seed=st.integers(0, 2**31),
    topk=st.integers(1, 4),
    steps=st.integers(1, 4),
    extra_vocab=st.integers(0, 8),
    ties=st.booleans(),
    data=st.data(),
)
def test_tree_builder_matches_oracle(seed, topk, steps, extra_vocab, ties, data):
    V = topk + extra_vocab
    N = data.draw(st.integers(2, max_nodes(topk, steps)), label="N")
    row = draft_row_fn(seed, V, ties)
    b, tree, cands = run_builder(TreeBuilder, 11, topk, steps, row, N)
    tokens, parents, ocands = O.eagle_tree(11, topk, steps, row, N)
    assert (list(tree.tokens), list(tree.parents), cands) == (tokens, parents, ocands)
    assert tree.n == N and tree.tokens[0] == 11
    assert b.num_candidates == max_nodes(topk, steps) - 1
    for i in range(1, tree.n):
        nodes = tree.path(i)[1:]
        assert b.cands_of(cands[i - 1]) == [cands[j - 1] for j in nodes]
        assert b.tokens_of(cands[i - 1]) == [tree.tokens[j] for j in nodes]
    if topk == 1:
        assert tree.parents == tuple(range(-1, N - 1))


def test_tree_builder_errors():
    b = TreeBuilder(0, 2)
    with pytest.raises(ValueError, match="shape"):
        b.step(torch.rand(2, 5))  # step 0 takes the root's single row
    with pytest.raises(ValueError, match="smaller than topk"):
        b.step(torch.rand(1, 1))
    leaves = b.step(torch.tensor([[0.1, 0.5, 0.4]]))
    assert leaves == [0, 1] and b.tokens_of(0) == [1] and b.tokens_of(1) == [2]
    with pytest.raises(ValueError, match="only 2 recorded"):
        b.finish(4)
    assert b.finish(1)[0] == DraftTree((0,), (-1,))
    with pytest.raises(ValueError, match="shape"):
        b.step(torch.rand(1, 3))  # two leaves, two rows
    with pytest.raises(ValueError):
        TreeBuilder(0, 0)


def test_tree_builder_known_case():
    """topk 2, two steps, by hand: step 0 root row (.5 .3 .2) -> A=tok0 (.5), B=tok1 (.3);
    step 1 rows: A -> tok2 .6, tok0 .4 ; B -> tok1 .9, tok2 .1; scores .30 .20 .27 .03."""
    b = TreeBuilder(9, 2)
    assert b.step(torch.tensor([[0.5, 0.3, 0.2]])) == [0, 1]
    leaves = b.step(torch.tensor([[0.4, 0.0, 0.6], [0.0, 0.9, 0.1]]))
    assert leaves == [2, 4]  # .30 (A,tok2) then .27 (B,tok1)
    # fp32(0.5) * fp32(0.6) is exactly fp32(0.3), B's score: the tie goes to the lower id (B = 1)
    tree, cands = b.finish(3)
    assert cands == [0, 1] and tree.tokens == (9, 0, 1) and tree.parents == (-1, 0, 0)
    tree, cands = b.finish(4)
    assert cands == [0, 1, 2] and tree.tokens == (9, 0, 1, 2) and tree.parents == (-1, 0, 0, 1)


class WrongLeavesBuilder(TreeBuilder):
    """Bug: expands only the children of the best leaf (the first K of each step's block)
    instead of the K best-scoring candidates of the block."""

    def step(self, probs):
        leaves = super().step(probs)
        if len(self._scores) > 1:
            base = self.num_candidates - self.topk * self.topk
            self._leaves = list(range(base, base + self.topk))
            self._leaf_scores = self._scores[-1][: self.topk]
            return list(self._leaves)
        return leaves


def _topk_higher_index_first(x, k):
    """Bug: the tie rule reversed (higher index first on equal values)."""
    vals, idx = topk_stable(x.flip(-1), k)
    return vals, x.shape[-1] - 1 - idx


def test_broken_tree_builders_are_caught(monkeypatch):
    seeds = range(60)
    assert all(matches_oracle(TreeBuilder, s) for s in seeds)
    assert not all(matches_oracle(WrongLeavesBuilder, s) for s in seeds)
    monkeypatch.setattr(tree_mod, "topk_stable", _topk_higher_index_first)
    assert not all(matches_oracle(TreeBuilder, s) for s in seeds)


# ---------------------------------------------------------------------------------------------
# Greedy acceptance


@HYP
@given(tree=draft_trees(), mode=st.sampled_from(["random", "none", "deepest"]), data=st.data())
def test_greedy_accept_matches_oracle(tree, mode, data):
    argmax = data.draw(st.lists(st.integers(0, 3), min_size=tree.n, max_size=tree.n), label="argmax")
    if mode == "none":
        argmax[0] = 4  # no token of the tree's vocabulary
    elif mode == "deepest":
        path = tree.path(deepest_leaf(tree))
        for a, b in zip(path, path[1:]):
            argmax[a] = tree.tokens[b]
    path, bonus = greedy_accept(tree, torch.tensor(argmax))
    assert (path, bonus) == O.greedy_accept(list(tree.tokens), list(tree.parents), argmax)
    assert bonus == argmax[path[-1]]
    if mode == "none":
        assert path == [0]


@HYP
@given(tree=draft_trees(max_n=10), data=st.data())
def test_greedy_accept_deepest_branch_unique_tokens(tree, data):
    tree = DraftTree(tuple(range(100, 100 + tree.n)), tree.parents)
    leaf = data.draw(st.sampled_from(tree.leaves()), label="leaf")
    argmax = [0] * tree.n
    path = tree.path(leaf)
    for a, b in zip(path, path[1:]):
        argmax[a] = tree.tokens[b]
    argmax[leaf] = 7
    assert greedy_accept(tree, argmax) == (path, 7)


def test_greedy_accept_edge_cases():
    assert greedy_accept(DraftTree((3,), (-1,)), [8]) == ([0], 8)
    #        0
    #   1(5) 2(5) 3(6)     duplicate 5 among the root's children
    #   4(7)  5(7)
    t = DraftTree((0, 5, 5, 6, 7, 7), (-1, 0, 0, 0, 1, 2))
    assert greedy_accept(t, [5, 7, 7, 0, 9, 9]) == ([0, 1, 4], 9)  # first copy wins
    assert greedy_accept(t, [5, 1, 7, 0, 9, 9]) == ([0, 1], 1)  # its row, not the twin's
    assert greedy_accept(t, [6, 7, 7, 2, 9, 9]) == ([0, 3], 2)
    assert greedy_accept(t, [1, 7, 7, 2, 9, 9]) == ([0], 1)  # nothing accepted
    with pytest.raises(ValueError):
        greedy_accept(t, [1, 2])


def broken_greedy_bonus_from_parent(tree, argmax):
    """Bug: the bonus is read from the parent's row instead of the last accepted node's."""
    path, _ = greedy_accept(tree, argmax)
    row = path[-2] if len(path) > 1 else path[-1]
    return path, int(argmax[row])


def test_broken_greedy_bonus_is_caught():
    rng = random.Random(1)
    cases = []
    for _ in range(100):
        t = random_tree(rng)
        cases.append((t, [rng.randrange(4) for _ in range(t.n)]))
    oracle = [O.greedy_accept(list(t.tokens), list(t.parents), a) for t, a in cases]
    assert [greedy_accept(t, a) for t, a in cases] == oracle
    assert [broken_greedy_bonus_from_parent(t, a) for t, a in cases] != oracle


# ---------------------------------------------------------------------------------------------
# Sampler transform


SAMPLING_ROW = st.tuples(
    st.sampled_from([0.0, 1e-7, 0.3, 0.7, 1.0, 1.6]),  # temperature
    st.sampled_from([-1, 0, 1, 2, 3, 5, TOP_K_ALL]),  # top_k
    st.sampled_from([0.05, 0.3, 0.5, 0.8, 0.95, 1.0]),  # top_p
    st.sampled_from([0.0, 0.05, 0.2, 0.5]),  # min_p
)


@HYP
@given(
    V=st.integers(2, 12),
    params=st.lists(SAMPLING_ROW, min_size=1, max_size=4),
    data=st.data(),
)
def test_target_probs_matches_oracle(V, params, data):
    # logits on a quarter-unit grid: exact ties are common (the tie rule is exercised) while distinct
    # logits are far apart, so fp32 and float64 rank them alike
    grid = st.lists(st.integers(-16, 16), min_size=V, max_size=V)
    logits = [[q / 4 for q in data.draw(grid, label=f"logits{i}")] for i in range(len(params))]
    for row, (t, k, p, m) in zip(logits, params):
        assume(O.sampler_margin(row, t, k, p, m) > 1e-5)
    cols = list(zip(*params))
    out = target_probs(
        torch.tensor(logits),
        torch.tensor(cols[0]),
        torch.tensor(cols[1]),
        torch.tensor(cols[2]),
        torch.tensor(cols[3]),
    )
    assert out.dtype == torch.float32 and out.shape == (len(params), V)
    want = torch.tensor([O.sampler_probs(row, *pr) for row, pr in zip(logits, params)])
    torch.testing.assert_close(out, want, atol=1e-5, rtol=0)
    assert torch.equal(out > 0, want > 0)


def test_target_probs_scalar_params_and_errors():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    out = target_probs(logits, 1.0, -1, 1.0, 0.0)
    torch.testing.assert_close(out, torch.softmax(logits, -1))
    greedy = target_probs(logits, 0.0, -1, 1.0, 0.0)
    assert greedy.tolist() == [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]]  # ties: lowest token id
    with pytest.raises(ValueError, match="temperature"):
        target_probs(logits, -1.0, -1, 1.0, 0.0)
    with pytest.raises(ValueError, match="shape"):
        target_probs(logits, torch.ones(3), -1, 1.0, 0.0)


def _load_sglang_filter():
    """SGLang's own `top_k_top_p_min_p_sampling_from_probs_torch`, compiled from its source file
    alone: importing sglang.srt.layers.sampler drags in the whole runtime (~13 s on this machine),
    while the function itself only needs torch (multinomial_with_seed only on the seeded path)."""
    spec = importlib.util.find_spec("sglang")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("sglang not installed")
    path = Path(list(spec.submodule_search_locations)[0]) / "srt" / "layers" / "sampler.py"
    if not path.exists():
        pytest.skip(f"{path} not found")
    name = "top_k_top_p_min_p_sampling_from_probs_torch"
    body = ast.parse(path.read_text()).body
    fns = [n for n in body if isinstance(n, ast.FunctionDef) and n.name == name]
    if not fns:
        pytest.skip(f"{name} not in {path}")
    ns = {"torch": torch, "Optional": Optional}
    exec(compile(ast.Module(body=fns, type_ignores=[]), str(path), "exec"), ns)
    return ns[name]


def test_target_probs_matches_sglang_function():
    sglang_filter = _load_sglang_filter()
    g = torch.Generator().manual_seed(0)
    n, V = 96, 40
    logits = torch.randn(n, V, generator=g) * 3  # continuous: no ties, whose order SGLang leaves open
    rng = random.Random(0)
    temp = torch.tensor([rng.choice([0.0, 0.4, 1.0, 1.5]) for _ in range(n)])
    top_k = torch.tensor([rng.choice([TOP_K_ALL, 1, 3, 10, 39]) for _ in range(n)])
    top_p = torch.tensor([rng.choice([1.0, 0.9, 0.5, 0.2]) for _ in range(n)])
    min_p = torch.tensor([rng.choice([0.0, 0.0, 0.1, 0.3]) for _ in range(n)])
    # SGLang's representation of a greedy request: temperature 1, top_k 1 (SamplingParams.normalize)
    greedy = temp == 0
    s_temp = torch.where(greedy, 1.0, temp)
    s_top_k = torch.where(greedy, 1, top_k)
    probs = torch.softmax(logits / s_temp[:, None], dim=-1)
    _, filtered, idx, _ = sglang_filter(
        probs.clone(), s_top_k, top_p, min_p, True, None, torch.zeros(n), return_filtered_probs=True
    )
    want = torch.zeros_like(probs).scatter_(-1, idx.long(), filtered)
    want = want / want.sum(-1, keepdim=True)
    # top_p == 1 rows: SGLang would still drop tail tokens whose fp32 prefix rounds above 1 (mass ~1e-7)
    for t, k in ((temp, top_k), (s_temp, s_top_k)):  # our greedy spelling and SGLang's
        torch.testing.assert_close(target_probs(logits, t, k, top_p, min_p), want, atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# Rejection sampling: structure


@HYP
@given(tree=draft_trees(), seed=st.integers(0, 2**31))
def test_sample_accept_at_temperature_zero_is_greedy(tree, seed):
    logits = torch.randn(tree.n, 4, generator=torch.Generator().manual_seed(seed)).round()  # ties too
    probs = target_probs(logits, 0.0, -1, 1.0, 0.0)
    want = greedy_accept(tree, logits.argmax(-1))
    assert sample_accept(tree, probs, torch.Generator().manual_seed(seed)) == want
    chain = DraftTree.chain(tree.tokens)
    want = greedy_accept(chain, logits.argmax(-1))
    draft = torch.full((tree.n, 4), 0.25)
    assert sample_accept(chain, probs, torch.Generator().manual_seed(seed), draft_probs=draft) == want


def test_sample_accept_errors_and_chain_edges():
    g = torch.Generator().manual_seed(0)
    t = DraftTree((0, 1, 2), (-1, 0, 0))
    p = torch.full((3, 4), 0.25)
    with pytest.raises(ValueError, match="chains"):
        sample_accept(t, p, g, draft_probs=p)
    with pytest.raises(ValueError, match="probs"):
        sample_accept(t, p[:2], g)
    single = DraftTree.chain([3])
    onehot = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    assert sample_accept(single, onehot, g, draft_probs=onehot[:0]) == ([0], 2)
    assert sample_accept(single, onehot, g) == ([0], 2)
    # the caller's rows are read, never written (residuals are zeroed on a copy)
    probs = torch.softmax(torch.randn(3, 4, generator=g), -1).double()
    before = probs.clone()
    for _ in range(20):
        sample_accept(DraftTree((0, 1, 1), (-1, 0, 0)), probs, g)
        sample_accept(DraftTree.chain([0, 1, 2]), probs, g, draft_probs=probs.flip(-1))
    assert torch.equal(probs, before)
    # q == p, one-hot: every draft is accepted and the bonus comes from the last row
    chain = DraftTree.chain([0, 1, 2])
    p = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    assert sample_accept(chain, p, g, draft_probs=p) == ([0, 1, 2], 3)


def test_accept_batch_dispatch():
    g = torch.Generator().manual_seed(0)
    trees = [random_tree(random.Random(s), vocab=5) for s in range(4)]
    logits = [torch.randn(t.n, 5, generator=g) for t in trees]
    sampling = [
        None,
        dict(temperature=0.0, top_k=-1, top_p=1.0, min_p=0.0),
        dict(temperature=0.8, top_k=3, top_p=0.9, min_p=0.05),
        dict(temperature=1.2),
    ]
    gen = torch.Generator().manual_seed(5)
    got = accept_batch(trees, logits, sampling, gen)
    ref_gen = torch.Generator().manual_seed(5)
    want = [
        greedy_accept(trees[0], logits[0].argmax(-1)),
        greedy_accept(trees[1], logits[1].argmax(-1)),
        sample_accept(trees[2], target_probs(logits[2], 0.8, 3, 0.9, 0.05), ref_gen),
        sample_accept(trees[3], target_probs(logits[3], 1.2, -1, 1.0, 0.0), ref_gen),
    ]
    assert got == want
    all_greedy = [greedy_accept(t, lg.argmax(-1)) for t, lg in zip(trees, logits)]
    assert accept_batch(trees, logits, None, gen) == all_greedy
    with pytest.raises(ValueError):
        accept_batch(trees, logits[:2], None, gen)


# ---------------------------------------------------------------------------------------------
# Rejection sampling: losslessness (chi-square at a fixed seed)

V_SMALL = 6
DRAWS = 30_000  # see test_sample_size_detects_a_2_percent_shift
BIASED_DRAWS = 10_000
ALPHA = 1e-3


def _dist(g, *shape, sharp=1.0):
    p = torch.softmax(torch.randn(*shape, V_SMALL, generator=g) * sharp, dim=-1).double()
    return p / p.sum(-1, keepdim=True)  # rows summing to 1 in float64, so expected counts sum to n


def _chi2_pvalues(pairs, p_first, p_second_given):
    """p-values of the first-token and the (first, second)-pair counts against the exact
    sequential-sampling distribution."""
    n = len(pairs)
    joint = O.sequential_joint(p_first.tolist(), lambda x: p_second_given[x].tolist())
    first = torch.bincount(torch.tensor([x for x, _ in pairs]), minlength=V_SMALL).double()
    pair_ids = torch.tensor([x * V_SMALL + y for x, y in pairs])
    pair_counts = torch.bincount(pair_ids, minlength=V_SMALL**2).double()
    cells = [(x, y) for x in range(V_SMALL) for y in range(V_SMALL)]
    exp_pairs = torch.tensor([joint[c] for c in cells], dtype=torch.float64)
    exp_pairs = exp_pairs / exp_pairs.sum() * n  # chisquare wants equal totals to ~1e-8
    exp_first = exp_pairs.view(V_SMALL, V_SMALL).sum(1)
    assert exp_pairs.min() > 5  # the chi-square approximation holds
    return chisquare(first, exp_first).pvalue, chisquare(pair_counts, exp_pairs).pvalue


def _alone_draws(P1, n, g):
    """[n, V] second tokens drawn in advance: column x ~ P1[x], the target after token x."""
    cols = [torch.multinomial(P1[x], n, replacement=True, generator=g) for x in range(V_SMALL)]
    return torch.stack(cols, 1)


def _first_two(emitted, next_if_alone):
    # a round that emits a single token leaves the second to the next round, which samples it
    # from the target given the first: next_if_alone is such a draw, made in advance
    return emitted[0], (emitted[1] if len(emitted) > 1 else next_if_alone[emitted[0]])


class ChainModel:
    """Target and draft over V_SMALL tokens for a depth-2 chain: P0 = target after the root,
    P1[x] after x, P2[x, y] after (x, y); drafts d1 ~ Q0, d2 ~ Q1[d1], with q != p."""

    def __init__(self):
        g = torch.Generator().manual_seed(7)
        self.P0, self.P1, self.P2 = _dist(g), _dist(g, V_SMALL), _dist(g, V_SMALL, V_SMALL)
        self.Q0, self.Q1 = _dist(g, sharp=2.0), _dist(g, V_SMALL, sharp=2.0)
        self.cache = {}

    def rows(self, d1, d2):
        if (d1, d2) not in self.cache:
            probs = torch.stack([self.P0, self.P1[d1], self.P2[d1, d2]])
            draft = torch.stack([self.Q0, self.Q1[d1]])
            self.cache[(d1, d2)] = (DraftTree.chain([0, d1, d2]), probs, draft)
        return self.cache[(d1, d2)]

    def run(self, accept_fn, n, seed):
        g = torch.Generator().manual_seed(seed)
        aux = torch.Generator().manual_seed(seed + 1)
        d1 = torch.multinomial(self.Q0, n, replacement=True, generator=aux)
        d2 = torch.multinomial(self.Q1[d1], 1, generator=aux)[:, 0]
        alone = _alone_draws(self.P1, n, aux)
        pairs = []
        for i, (a, b) in enumerate(zip(d1.tolist(), d2.tolist())):
            tree, probs, draft = self.rows(a, b)
            path, bonus = accept_fn(tree, probs, g, draft)
            pairs.append(_first_two([tree.tokens[j] for j in path[1:]] + [bonus], alone[i].tolist()))
        return _chi2_pvalues(pairs, self.P0, self.P1)


class TreeModel:
    """A fixed topk-3 tree over V_SMALL tokens with a duplicate root child:
             root
        1(a=0)  2(b=1)  3(a=0)
        4(3) 5(4) 6(0)  7(5)
    Target: P0 after the root, P1[x] after token x (every depth-1 node's row, so the duplicate's
    row equals the original's, as a real model would give), arbitrary rows deeper down. P0 puts
    most mass on the children tokens so both acceptance and rejection are common."""

    def __init__(self):
        g = torch.Generator().manual_seed(11)
        self.tree = DraftTree((9, 0, 1, 0, 3, 4, 0, 5), (-1, 0, 0, 0, 1, 1, 2, 3))
        self.P0 = torch.tensor([0.3, 0.25, 0.15, 0.1, 0.1, 0.1], dtype=torch.float64)
        self.P1 = _dist(g, V_SMALL)
        deep = _dist(g, 4)
        self.probs = torch.cat([self.P0[None], self.P1[[0, 1, 0]], deep])

    def run(self, accept_fn, n, seed):
        g = torch.Generator().manual_seed(seed)
        aux = torch.Generator().manual_seed(seed + 1)
        alone = _alone_draws(self.P1, n, aux)
        pairs = []
        for i in range(n):
            path, bonus = accept_fn(self.tree, self.probs, g, None)
            emitted = [self.tree.tokens[j] for j in path[1:]] + [bonus]
            pairs.append(_first_two(emitted, alone[i].tolist()))
        return _chi2_pvalues(pairs, self.P0, self.P1)


def test_sample_size_detects_a_2_percent_shift():
    """Moving d = 2 % of probability from one cell to another raises the chi-square
    noncentrality by DRAWS * (d^2 / p_a + d^2 / p_b) >= DRAWS * 2 d^2 / p_max; at ALPHA the
    test must then reject with probability > 0.99, for the first token (V - 1 dof) and the
    pairs (V^2 - 1 dof) of both models below."""
    for model in (ChainModel(), TreeModel()):
        joint = O.sequential_joint(model.P0.tolist(), lambda x: model.P1[x].tolist())
        joint = torch.tensor(list(joint.values()))
        for dof, p_max in ((V_SMALL - 1, model.P0.max().item()), (V_SMALL**2 - 1, joint.max().item())):
            lam = DRAWS * 2 * 0.02**2 / p_max
            assert ncx2.sf(chi2.isf(ALPHA, dof), dof, lam) > 0.99, (type(model).__name__, dof, p_max)


def _fast(tree, probs, g, draft):
    return sample_accept(tree, probs, g, draft_probs=draft)


def test_chain_rejection_sampling_is_lossless():
    p_first, p_pair = ChainModel().run(_fast, DRAWS, seed=100)
    assert p_first > ALPHA and p_pair > ALPHA, (p_first, p_pair)


def test_tree_rejection_sampling_is_lossless():
    p_first, p_pair = TreeModel().run(_fast, DRAWS, seed=200)
    assert p_first > ALPHA and p_pair > ALPHA, (p_first, p_pair)


def biased_chain_resample_from_p(tree, probs, g, draft):
    """Bug: after a rejection the bonus is drawn from p instead of normalize(max(p - q, 0))."""
    node = 0
    while node + 1 < tree.n:
        d = tree.tokens[node + 1]
        if torch.rand((), generator=g, dtype=torch.float64) * draft[node, d] >= probs[node, d]:
            return list(range(node + 1)), int(torch.multinomial(probs[node], 1, generator=g))
        node += 1
    return list(range(node + 1)), int(torch.multinomial(probs[node], 1, generator=g))


def _biased_tree(tree, probs, g, *, renormalize=True, zero_rejected=True, bonus_from_residual=True):
    path = [0]
    while True:
        node = path[-1]
        r = probs[node].clone()
        for c in tree.children(node):
            tok = tree.tokens[c]
            accept_p = r[tok] / r.sum() if renormalize else r[tok]
            if torch.rand((), generator=g, dtype=torch.float64) < accept_p:
                path.append(c)
                break
            if zero_rejected:
                r[tok] = 0.0
        else:
            weights = r if bonus_from_residual and r.sum() > 0 else probs[node]
            return path, int(torch.multinomial(weights, 1, generator=g))


BIASED_TREE_RULES = {
    "bonus from p, not the residual": dict(bonus_from_residual=False),
    "accept with r(c), not r(c)/sum(r)": dict(renormalize=False),
    "rejected token not zeroed (duplicate gets a second chance)": dict(zero_rejected=False),
}


@pytest.mark.parametrize("bug", list(BIASED_TREE_RULES))
def test_biased_tree_rules_are_detected(bug):
    kw = BIASED_TREE_RULES[bug]

    def rule(tree, probs, g, _draft):
        return _biased_tree(tree, probs, g, **kw)

    p_first, p_pair = TreeModel().run(rule, BIASED_DRAWS, seed=300)
    assert min(p_first, p_pair) < 1e-6, (p_first, p_pair)


def test_biased_chain_rule_is_detected():
    p_first, p_pair = ChainModel().run(biased_chain_resample_from_p, BIASED_DRAWS, seed=400)
    assert min(p_first, p_pair) < 1e-6, (p_first, p_pair)
