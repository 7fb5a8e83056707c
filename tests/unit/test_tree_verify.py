"""Tree verify and commit against the model: every tree node sees exactly the committed history and
its own ancestors, and committing an accepted path stores that path and nothing else.

The oracle for node i is a plain forward, from an empty cache and with the per-segment definition,
over prompt + the tokens of path(i). The tree crosses the SWA window (L >> window), a CSA 4-token
block and the HCA 128-token block boundary at 256 while it is being verified. Broken variants (a
tree run in node order, the wrong path committed, rejected compressor rows kept) must be caught.
"""

import contextlib

import pytest
import torch
from oracles.decode import prefill

from sglang_dsv4_ascend.batch import Segment, SegmentWrites
from sglang_dsv4_ascend.kvcache import plan as plan_mod
from sglang_dsv4_ascend.speculative.tree import DraftTree

TOL = dict(atol=1e-4, rtol=1e-4)
L = 254  # the tree's positions 254..257 cross the 4-block at 256 and the 128-block at 256

# (tokens, parents): a topk-2 tree of depth 3 with a branch completing the 256 boundary only on
# its second child, a topk-3 tree of depth 2, and a chain.
TREES = [
    ((11, 21, 22, 31, 32, 33, 41), (-1, 0, 0, 1, 1, 2, 4)),
    ((11, 21, 22, 23, 31, 32, 33), (-1, 0, 0, 0, 1, 2, 3)),
    ((11, 21, 31, 41), (-1, 0, 1, 2)),
]


def _ids(n, seed):
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed))


@contextlib.contextmanager
def impl(model, name):
    old = model.attention_impl
    model.attention_impl = name
    try:
        yield
    finally:
        model.attention_impl = old


def _forward(model, cache, segs, ids, pending=None):
    pos = torch.cat([s.start + torch.tensor(s.depths()) for s in segs])
    return model.compute_logits(model(ids, pos, segs, cache, pending=pending))


def _oracle(model, ids):
    """Last-row logits of a fresh full forward with the per-segment definition."""
    with impl(model, "segments"):
        cache = model.make_cache(1, ids.shape[0] + 8)
        return _forward(model, cache, [Segment(0, 0, ids.shape[0])], ids)


def _prefilled(model, prompt, slots=1):
    # No speculative slack: with deferred writes nothing rejected is ever stored, so the rings need
    # none, and a kept rejected row lands on a committed row still in use (the broken variant).
    cache = model.make_cache(slots, 320, 0)
    for t in cache.state_tensors().values():  # any read of a row never written turns NaN
        t.fill_(float("nan"))
    _forward(model, cache, [Segment(0, 0, prompt.shape[0])], prompt)
    return cache


def tree_verify(model, cache, tree: DraftTree, start: int, slot: int = 0, nodes: bool = False):
    """The worker's verify: one deferred segment per root-to-leaf path, or (`nodes`) one tree
    segment computing each node once. Returns (node logits, pending, segments, leaf -> segment
    index; None for the tree segment)."""
    if nodes:
        pending, seg = [], Segment(slot, start, tree.n, tuple(tree.parents))
        return _forward(model, cache, [seg], torch.tensor(tree.tokens), pending), pending, [seg], None
    segs, ids, first, leaf_seg, row = [], [], {}, {}, 0
    for path in tree.paths():
        leaf_seg[path[-1]] = len(segs)
        segs.append(Segment(slot, start, len(path)))
        for d, node in enumerate(path):
            first.setdefault(node, row + d)
        ids += [tree.tokens[n] for n in path]
        row += len(path)
    pending = []
    logits = _forward(model, cache, segs, torch.tensor(ids), pending)
    return logits[[first[i] for i in range(tree.n)]], pending, segs, leaf_seg


def commit(cache, tree, pending, segs, leaf_seg, path, leaf=None):
    """Store `path` (a root-prefix of some leaf's path): that leaf's segment keeps len(path), or
    the tree segment keeps the path itself."""
    if leaf_seg is None:
        cache.apply(pending, keep=(tuple(path),))
        return
    if leaf is None:
        leaf = next(lf for lf in tree.leaves() if tree.path(lf)[: len(path)] == path)
    keep = [0] * len(segs)
    keep[leaf_seg[leaf]] = len(path)
    cache.apply(pending, keep=tuple(keep))


# how the verify runs: path by path with either attention, or node-once (batched path only)
VERIFY = [("batched", False), ("segments", False), ("batched", True)]


def _node_errors(model, prompt, got, tree):
    return [
        (got[i] - _oracle(model, torch.cat([prompt, torch.tensor([tree.tokens[n] for n in tree.path(i)])]))[-1])
        .abs()
        .max()
        .item()
        for i in range(tree.n)
    ]


@pytest.mark.parametrize("preset,name,nodes", [("flash", *v) for v in VERIFY] + [("pro", "batched", True)])
@pytest.mark.parametrize("t", range(len(TREES)))
def test_tree_node_logits_equal_a_full_forward_over_its_path(dsv4_model, name, nodes, t, preset):
    model, prompt = dsv4_model(preset), _ids(L, 12)
    tree = DraftTree(*TREES[t])
    cache = _prefilled(model, prompt)
    with impl(model, name):
        got, _, _, _ = tree_verify(model, cache, tree, L, nodes=nodes)
    for i in range(tree.n):
        ref = _oracle(model, torch.cat([prompt, torch.tensor([tree.tokens[n] for n in tree.path(i)])]))[-1]
        torch.testing.assert_close(got[i], ref, **TOL, msg=f"node {i} of tree {t}")


@pytest.mark.parametrize("broken", ["window_in_node_order", "siblings_entries_visible"])
def test_broken_node_once_geometry_is_caught(dsv4_model, monkeypatch, broken):
    """Node-once verify with a node's window rows taken in node order (a sibling's branch instead
    of its ancestors) or with every entry the tree completes visible to every node (a sibling's
    CSA / HCA entry at 255): the oracle comparison must fail."""
    if broken == "window_in_node_order":
        monkeypatch.setattr(plan_mod._Tree, "ancestor_at", lambda self, d, nodes=None: d.clamp(0, self.seg.length - 1))
    else:
        real = plan_mod._ratio_plan

        def all_visible(*a, **k):
            rp = real(*a, **k)
            if rp.new_mask is not None:
                rp.new_mask.fill_(True)
            return rp

        monkeypatch.setattr(plan_mod, "_ratio_plan", all_visible)
    model, prompt = dsv4_model("flash"), _ids(L, 12)
    tree = DraftTree(*TREES[0])
    got, _, _, _ = tree_verify(model, _prefilled(model, prompt), tree, L, nodes=True)
    assert max(_node_errors(model, prompt, got, tree)) > 1e-2


def test_broken_node_order_chain_is_caught(dsv4_model):
    """Running the tree's nodes as one chain in index order lets siblings see each other and counts
    the window in slot order: the oracle comparison must fail."""
    model, prompt = dsv4_model("flash"), _ids(L, 12)
    tree = DraftTree(*TREES[0])
    cache = _prefilled(model, prompt)
    got = _forward(model, cache, [Segment(0, L, tree.n)], torch.tensor(tree.tokens), pending=[])
    errs = _node_errors(model, prompt, got, tree)
    assert max(errs) > 1e-2, errs


# A deep chain: accepting 3 of its 7 rows at 254 leaves 4 rejected rows (257..260) whose compressor
# ring rows (8 per CSA ring) are those of 249..252, and 252 is still pooled by entry 64 (252..259).
CHAIN7 = (tuple(range(51, 58)), tuple(range(-1, 6)))


def _two_rounds(model, prompt, paths, leaves=(None, None), cont=8, trees=(TREES[0], TREES[1]), nodes=False):
    """Tree rounds (TREES[0] then TREES[1]) each committing `paths[k]`, then `cont` plain decode
    tokens. Returns (logits of the decoded tokens, the full-forward reference)."""
    cache = _prefilled(model, prompt)
    seq, start = prompt.tolist(), L
    for k, (spec, path) in enumerate(zip(trees, paths)):
        tree = DraftTree(*spec)
        _, pending, segs, leaf_seg = tree_verify(model, cache, tree, start, nodes=nodes)
        commit(cache, tree, pending, segs, leaf_seg, path, leaves[k])
        seq += [tree.tokens[n] for n in path]
        start += len(path)
    tail = _ids(cont, 5)
    got = torch.cat([_forward(model, cache, [Segment(0, start + j, 1)], tail[j : j + 1]) for j in range(cont)])
    full = torch.cat([torch.tensor(seq), tail])
    with impl(model, "segments"):
        ref = _forward(model, model.make_cache(1, full.shape[0] + 8), [Segment(0, 0, full.shape[0])], full)
    return got, ref[len(seq) :]


# Accepted paths: the second branch to depth 2 (its sibling subtree rejected, partial accept),
# then only the root (zero accept) or the deepest branch (full accept).
ACCEPTS = [([0, 2, 5], [0]), ([0, 1, 4, 6], [0, 3, 6]), ([0], [0, 1, 4])]


@pytest.mark.parametrize("name,nodes", VERIFY)
@pytest.mark.parametrize("paths", ACCEPTS)
def test_commit_stores_the_accepted_path_only(dsv4_model, name, nodes, paths):
    model = dsv4_model("flash")
    with impl(model, name):
        got, ref = _two_rounds(model, _ids(L, 12), paths, nodes=nodes)
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("name,nodes", VERIFY)
def test_commit_of_a_short_prefix_of_a_deep_chain(dsv4_model, name, nodes):
    model = dsv4_model("flash")
    with impl(model, name):
        got, ref = _two_rounds(model, _ids(L, 12), ([0, 1, 2],), trees=(CHAIN7,), nodes=nodes)
    torch.testing.assert_close(got, ref, **TOL)


def test_broken_node_once_commit_of_a_sibling_is_caught(dsv4_model):
    """A tree commit whose stored rows are the accepted path's depth-mates in another branch."""
    model = dsv4_model("flash")
    real = plan_mod._stored
    swap = {(0, 2, 5): (0, 1, 4)}  # same depths, the other branch
    plan_mod_stored = lambda n, seg: swap.get(real(n, seg), real(n, seg)) if seg.parents else real(n, seg)  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(plan_mod, "_stored", plan_mod_stored)
        got, ref = _two_rounds(model, _ids(L, 12), ([0, 2, 5], [0]), nodes=True)
    assert (got - ref).abs().max() > 1e-2


def test_broken_commit_of_the_wrong_path_is_caught(dsv4_model):
    model = dsv4_model("flash")
    # accepted [0, 2, 5] but the first leaf's segment (3 = via node 1) stored instead
    got, ref = _two_rounds(model, _ids(L, 12), ([0, 2, 5], [0]), leaves=(3, None))
    assert (got - ref).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["batched", "segments"])
def test_broken_commit_keeping_rejected_compressor_rows_is_caught(dsv4_model, monkeypatch, name):
    """The measured hole of the earlier commit path: rejected rows of the accepted path's segment
    stored in the compressor rings clobber rows the next block still pools."""
    model = dsv4_model("flash")
    orig_prefix, orig_lists = SegmentWrites.prefix, plan_mod._write_lists

    def prefix_keeping_rows(self, n):
        w = orig_prefix(self, n)
        w.rows = self.rows  # every row, rejected ones included
        return w

    def lists_keeping_rows(plan, lengths):
        kept = orig_lists(plan, lengths)
        everything = orig_lists(
            plan,
            tuple(s.length if (lengths and lengths[i]) else 0 for i, s in enumerate(plan.segments))
            if lengths
            else None,
        )
        kept.rows = everything.rows
        return kept

    monkeypatch.setattr(SegmentWrites, "prefix", prefix_keeping_rows)
    monkeypatch.setattr(plan_mod, "_write_lists", lists_keeping_rows)
    with impl(model, name):
        got, ref = _two_rounds(model, _ids(L, 12), ([0, 1, 2],), trees=(CHAIN7,))
    assert (got - ref).abs().max() > 1e-2


@pytest.mark.parametrize(
    "steps,topk,n,flag",
    [
        (0, 1, 1, "--speculative-num-steps 0: must be >= 1"),
        (3, 0, 4, "--speculative-eagle-topk 0: must be >= 1"),
        (3, 1, 6, "--speculative-num-draft-tokens 6: a chain \\(topk 1\\) verifies steps \\+ 1 = 4"),
        (3, 4, 4, "--speculative-eagle-topk 4: at most --speculative-num-draft-tokens - 1 = 3"),
        (2, 2, 9, "--speculative-num-draft-tokens 9: .* must be in \\[2, 7\\]"),
    ],
)
def test_tree_shapes_the_worker_cannot_serve_name_the_flag(steps, topk, n, flag):
    from sglang_dsv4_ascend.speculative.engine import check_tree_shape

    with pytest.raises(ValueError, match=flag):
        check_tree_shape(steps, topk, n)
    check_tree_shape(3, 1, 4)
    check_tree_shape(3, 4, 8)


def _nextn_rounds(model, nextn, prompts, node_once, topk, steps, draft_tokens, rounds):
    """NextN engine rounds over `prompts` (real drafts, greedy): per round the drafted trees and
    the rows the verify ran, and each request's tokens."""
    import types

    from sglang_dsv4_ascend.speculative.drafters import NextNDrafter
    from sglang_dsv4_ascend.speculative.engine import SpecEngine

    host = types.SimpleNamespace(model=model, nextn=nextn, cfg=model.cfg)
    cache = model.make_cache(len(prompts), 320, draft_tokens)
    eng = SpecEngine(
        host, cache, NextNDrafter, torch.Generator(), topk=topk, num_steps=steps, num_draft_tokens=draft_tokens
    )
    eng.node_once = node_once
    got = prefill(model, eng, prompts)
    lens, trees, rows = [len(p) for p in prompts], [], []
    live = list(range(len(prompts)))
    for _ in range(rounds):
        r = eng.round(live, lens, [g[-1] for g in got], None, None, live)
        trees.append(r.trees)
        rows.append(r.plan["verify_rows"])
        for s, (e, a) in enumerate(zip(r.emitted, r.accept_lens)):
            got[s] += e
            lens[s] += a
    return trees, rows, got


def test_engine_rounds_node_once_equal_path_by_path_with_fewer_rows(dsv4_model, tiny_ckpt):
    """Whole NextN tree rounds (topk 4, real drafts, three requests crossing the 256 boundary),
    node-once against path by path: the same tokens every round, and the verify runs the trees'
    nodes only (fewer rows than the sum over leaves of depth + 1 whenever a tree branches)."""
    from sglang_dsv4_ascend.models.nextn import load_nextn_from_dir

    model = dsv4_model("flash")
    nextn = load_nextn_from_dir(tiny_ckpt("flash"), model.cfg)
    prompts = [_ids(n, 20 + n).tolist() for n in (250, 120, 33)]
    nodes = _nextn_rounds(model, nextn, prompts, True, 4, 3, 8, 4)
    paths = _nextn_rounds(model, nextn, prompts, False, 4, 3, 8, 4)
    assert nodes[2] == paths[2]
    for trees, rows in zip(nodes[0], nodes[1]):
        assert rows == sum(t.n for t in trees)
    for trees, rows in zip(paths[0], paths[1]):
        assert rows == sum(sum(t.depth()[lf] + 1 for lf in t.leaves()) for t in trees)
    assert all(a < b for a, b in zip(nodes[1], paths[1])), (nodes[1], paths[1])


@pytest.mark.parametrize("broken", [False, True])
def test_incremental_draft_steps_draft_the_path_by_path_trees(monkeypatch, broken):
    """NextN's draft steps computing only each step's new leaves (earlier candidates keyed from the
    rows earlier steps computed) draft exactly the trees that recomputing every leaf's whole path
    drafts, round by round (topk 4, 4 steps: candidates sharing ancestors, three requests across
    the 256 boundary). Broken: a past node keyed from its neighbour's row: caught."""
    from sglang_dsv4_ascend import TINY_NEXTN_MODEL_PATH
    from sglang_dsv4_ascend.models.nextn import load_nextn_from_dir
    from sglang_dsv4_ascend.models.weights import load_model_from_dir

    model = load_model_from_dir(TINY_NEXTN_MODEL_PATH)  # trained: its attention tells keys apart
    nextn = load_nextn_from_dir(TINY_NEXTN_MODEL_PATH, model.cfg)
    prompts = [_ids(n, 40 + n).tolist() for n in (252, 120, 33)]
    want = _nextn_rounds(model, nextn, prompts, False, 4, 4, 12, 3)[0]
    if broken:
        real = plan_mod._Tree.pool_rows

        def neighbour(self, T):
            rows = real(self, T)
            rows[: self.past] = rows[: self.past].roll(1)
            return rows

        monkeypatch.setattr(plan_mod._Tree, "pool_rows", neighbour)
    got = _nextn_rounds(model, nextn, prompts, True, 4, 4, 12, 3)[0]
    assert (got == want) != broken
