"""One speculative round over our DeepSeek-V4, free of SGLang objects: the worker adapts SGLang's
batches to it, the benchmark drives it in process.

For a request with committed length L (target and draft caches hold positions < L) and bonus token
b (the last sample, at position L, in no cache yet):

1. draft: the draft state left by the last draft extend (logits and output streams of its row
   L-1, which read (b, target streams at L-1)) gives the root's children; each further step runs
   the NextN block over the current leaves only (one tree segment per request at start L whose
   earlier candidates are past nodes keyed from the rows earlier steps computed, writes
   discarded; path by path, one segment per leaf, when the steps are captured) and extends the
   tree (tree.TreeBuilder, SGLang's EAGLE scheme);
2. verify: the target runs one segment per request, writes deferred; a tree's segment carries
   its parents (`Segment.parents`, kvcache/plan.py), so each node is one row at L + depth that
   sees exactly the committed history and its own ancestors: its SWA window along its path, the
   compressed entries its own ancestors complete, indexer top-k of its own. Under the per-segment
   definition (SGLANG_DSV4_ATTENTION=segments), or SGLANG_DSV4_TREE_VERIFY=paths, or when only
   the path form fits a captured bucket, the tree runs as one segment per root-to-leaf path
   instead (`verify_segments`), shared prefixes recomputed;
3. accept (accept.py): greedy or lossless rejection sampling over the tree. Only the accepted
   path is stored (`cache.apply(pending, keep=...)`: the tree segment's path, or a prefix of one
   leaf's path segment): nothing of a rejected node reaches any cache or compressor row;
4. draft extend: the NextN block reads (the accepted tokens after b and the new bonus, the
   target's streams at the accepted rows) at positions L .. L' - 1, into its own SWA cache; its
   last row is the next round's draft state.

The emitted tokens are tokens[path[1:]] + [bonus]; accept_len = len(path) (bonus included).

DSpark runs the same round with a chain: draft is one block forward of the DSpark draft plus its
Markov loop (drafters.DSparkDrafter: tokens, the q they were drawn from, confidences); a `plan`
stage (planner.Planner) cuts each chain to its verify length before step 2, so the target runs only
the chosen rows; accept uses q for sampled chains; extend injects the target features of the
committed rows into every stage's context ring.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from .. import settings
from ..batch import Segment
from .accept import accept_batch
from .planner import Decision
from .tree import DraftTree

STAGES = ("draft", "plan", "verify", "accept", "commit", "extend")


@dataclass
class RoundResult:
    emitted: list  # per request: accepted draft tokens + the bonus
    accept_lens: list  # per request: len(emitted)
    bonus: list  # per request: the new bonus token
    paths: list  # per request: accepted node indices (root first)
    trees: list  # per request: the verified DraftTree
    timings: dict = field(default_factory=dict)  # STAGES -> seconds
    drafted: list = field(default_factory=list)  # per request: draft tokens proposed (before planning)
    plan: dict = field(default_factory=dict)  # the planner's diagnostics (budget, rows, prediction)


@dataclass
class Drafts:
    """What a drafter proposes for a batch: one tree per request (a chain for DSpark), and for
    chains sampled from a distribution, that distribution per node with a child ([n - 1, V], None
    for deterministic proposals), and per-position confidences [R, gamma] when the drafter has a
    confidence head."""

    trees: list
    draft_probs: list | None = None
    confidence: torch.Tensor | None = None

    def truncated(self, lens) -> "Drafts":
        """Chains cut to their first lens[i] drafts (the planner's verify lengths)."""
        trees, probs = [], []
        for i, (t, n) in enumerate(zip(self.trees, lens)):
            trees.append(DraftTree(t.tokens[: n + 1], t.parents[: n + 1]))
            q = None if self.draft_probs is None else self.draft_probs[i]
            probs.append(None if q is None else q[:n])
        return Drafts(trees, probs if self.draft_probs is not None else None, self.confidence)


class _Stages:
    """Wall time per stage, each also a torch.profiler range named `dsv4_spec.<stage>` (the names an
    NPU timeline shows next to its kernels)."""

    def __init__(self):
        self.t = dict.fromkeys(STAGES, 0.0)

    @contextlib.contextmanager
    def __call__(self, name):
        t0 = time.perf_counter()
        with torch.profiler.record_function(f"dsv4_spec.{name}"):
            yield
        self.t[name] += time.perf_counter() - t0


class SpecEngine:
    def __init__(
        self, model, cache, drafter_factory, generator: torch.Generator, device=None, planner=None, sync=None, **shape
    ):
        """`model`: our DeepseekV4ForCausalLM-like object with `.model` (DSV4Model), `.cfg` and its
        draft (`.nextn` or `.dspark`); `cache`: the target's DSV4Cache. `shape`: the drafter's
        settings (topk, num_steps, num_draft_tokens for NextN; gamma for DSpark), kept as
        attributes. `planner` (planner.Planner): trims chains before verify. `sync`
        (distributed/spec_sync.RankSync): checks each round's decisions across ranks when asked."""
        self.model, self.cache, self.planner, self.sync = model, cache, planner, sync
        for k, v in shape.items():
            setattr(self, k, v)
        self.device = torch.device(device if device is not None else "cpu")
        self.generator = generator
        self.graphs = None  # graphs.VerifyGraphs when the verify is captured
        self.shapes = None  # shapes.ShapePlanner: NextN's round shape (tree, chain, none) per round
        self.guard = None  # guard.Guard: no drafting where plain decode steps measured faster
        self.draft_graphs = None  # graphs.DraftGraphs / NextNStepGraphs when the draft is captured
        self.node_once = settings.TREE_VERIFY.get() == "nodes"  # trees: verify_segments
        self.drafter = drafter_factory(self)
        if cache.prefix is not None and hasattr(self.drafter, "enable_prefix"):
            self.drafter.enable_prefix(cache.prefix)  # prefix hits restore the draft's state too

    def extend(self, segments, next_tokens, aux, rows, finals):
        """After a target forward committed `segments`: the drafter's context for them.
        `next_tokens` [T]: token i+1 of each row; `aux`: the forward's aux (pre-head "streams",
        "layer_streams"); `rows`: the forward's rows of the segments' tokens (None: all, in order);
        `finals`: (segment index, row) of requests whose draft state this row becomes."""
        self.drafter.extend(segments, next_tokens, aux, rows, finals)

    @torch.no_grad()
    def round(self, slots, starts, bonus, sampling=None, histories=None, gens=None) -> RoundResult:
        """One draft / plan / verify / accept / commit / extend round for these requests.
        `sampling[b]`: None (greedy) or the sampler's temperature/top_k/top_p/min_p; `histories[b]`:
        the request's tokens so far incl. the bonus (read only by the replay drafter); `gens[b]`:
        an id of the request in its slot (the planner's lag ring must not mix requests)."""
        stage = _Stages()
        gens = gens if gens is not None else [None] * len(slots)
        decision = None
        if self.graphs is not None:  # whether this round can replay: how the planners price it
            self.graphs.expect_round(starts)
        with stage("plan"):  # measured: whether drafting pays at this batch size (guard.Guard)
            drafting = self.guard is None or self.guard.draft(len(slots), list(zip(slots, gens)))
        if self.planner is not None:
            with stage("plan"):  # before drafting: whether to draft at all (planner.Planner.decide)
                decision = self.planner.decide(slots, gens) if drafting else Decision(0, skip=True)
        skip = not drafting or (decision is not None and decision.skip)
        shape = None
        if self.shapes is not None:
            with stage("plan"):  # the drafter reads the round's shape off the engine
                shape = self.shapes.choose(len(slots)) if drafting else "plain"
                self.topk, self.num_draft_tokens = self.shapes.geometry[shape]
            skip = shape == "plain"
        with stage("draft"):
            if skip:  # a plain decode step: each request verifies its anchor (bonus) row only
                drafts = Drafts([DraftTree([b], [-1]) for b in bonus])
            else:
                drafts = self.drafter.draft(slots, starts, bonus, histories, sampling)
                if not isinstance(drafts, Drafts):
                    drafts = Drafts(drafts)
        drafted = [t.n - 1 for t in drafts.trees]
        if not drafting:
            plan = {"skipped_draft": True, **({"shape": shape} if shape else {})}
        else:
            plan = dict(self.shapes.last) if self.shapes is not None else {}
        if self.planner is not None:
            with stage("plan"):
                lens = self.planner.plan(slots, gens, drafts.confidence, decision)
                drafts = drafts.truncated(lens)
                plan = dict(self.planner.last)
        if self.guard is not None:
            plan.update(self.guard.last)
        trees = drafts.trees

        with stage("verify"):
            trunk, dev = self.model.model, self.device
            # a captured verify takes chains only: a tree round it holds path by path runs
            # captured, any other node-once and eager
            layout = None
            if self.graphs is not None and not all(t.is_chain for t in trees):
                layout = verify_segments(slots, starts, trees, node_once=False)
                if self.graphs.bucket_for(layout[0]) is None:
                    layout = None
            if layout is None:
                node_once = self.node_once and trunk.attention_impl == "batched"
                layout = verify_segments(slots, starts, trees, node_once)
            segs, seg_first, ids, pos, node_rows, leaf_seg = layout
            pending, aux = [], {"layer_ids": getattr(self.drafter, "layer_ids", ())}
            ids_t, pos_t = torch.tensor(ids, device=dev), torch.tensor(pos, device=dev)
            hidden = None if self.graphs is None else self.graphs.run(segs, ids_t, pos_t, pending, aux)
            if hidden is None:
                hidden = trunk(ids_t, pos_t, segs, self.cache, pending=pending, aux=aux)
            rows = torch.tensor([r for rr in node_rows for r in rr], device=dev)
            logits = trunk.compute_logits(hidden[rows])
        with stage("accept"):
            results = accept_batch(
                trees, list(torch.split(logits, [t.n for t in trees])), sampling, self.generator, drafts.draft_probs
            )

        with stage("commit"):
            keep = [0] * len(segs)
            commit_rows, ext_segs, shifted = [], [], []
            out = RoundResult([], [], [], [], trees, drafted=drafted, plan={**plan, "verify_rows": len(ids)})
            for b, ((path, tok), tree) in enumerate(zip(results, trees)):
                if leaf_seg[b] is None:  # one segment for the request: a tree's path, or a chain's prefix
                    s = b
                    keep[s] = tuple(path) if segs[s].parents is not None else len(path)
                    commit_rows += [seg_first[s] + n for n in path]
                else:
                    leaf = next(lf for lf in tree.leaves() if tree.path(lf)[: len(path)] == path)
                    s = leaf_seg[b][leaf]
                    keep[s] = len(path)
                    commit_rows += range(seg_first[s], seg_first[s] + len(path))
                emitted = [tree.tokens[n] for n in path[1:]] + [tok]
                shifted += emitted  # draft row at L + i reads token L + i + 1
                ext_segs.append(Segment(slots[b], starts[b], len(path)))
                out.emitted.append(emitted)
                out.accept_lens.append(len(path))
                out.bonus.append(tok)
                out.paths.append(path)
            self.cache.apply(pending, keep=tuple(keep))
        if self.planner is not None:
            self.planner.learn([a - 1 for a in out.accept_lens])
        if self.sync is not None and self.sync.checking:  # the debug switch: no work per round without it
            self.sync.check(round_decisions(drafts, plan, out))
        with stage("extend"):
            ends, acc = [], 0
            for b, s in enumerate(ext_segs):
                acc += s.length
                ends.append((b, acc - 1))
            defer = {"defer": True} if skip and getattr(self.drafter, "defers", False) else {}
            self.drafter.extend(
                ext_segs, torch.tensor(shifted, device=dev), aux, torch.tensor(commit_rows, device=dev), ends, **defer
            )
        out.timings = stage.t
        if self.guard is not None:
            self.guard.learn(len(slots), not skip, sum(out.accept_lens), sum(stage.t.values()))
        if self.shapes is not None:
            self.shapes.learn(shape, len(slots), len(ids), out.accept_lens, sum(stage.t.values()), stage.t["draft"])
        if self.planner is not None:
            draft_s = None if skip else stage.t["draft"]
            self.planner.observe(len(slots), plan.get("rows", 0), sum(stage.t.values()), draft_s)
        return out


def verify_segments(slots, starts, trees, node_once: bool = True):
    """The verify forward's segments for each request's draft tree: (segments, first row of each,
    ids, positions, each request's node rows, each request's leaf -> segment or None).

    Node-once (the batched attention): one segment per request; a tree's segment carries its
    parents, so each node is computed once and sees its ancestors only (kvcache/plan.py), and a
    chain is a plain segment. Otherwise (the per-segment definition, which has no tree geometry)
    one segment per root-to-leaf path, shared prefixes recomputed on each path."""
    segs, seg_first, ids, pos, node_rows, leaf_seg = [], [], [], [], [], []
    for slot, L, tree in zip(slots, starts, trees):
        if node_once:
            seg = Segment(slot, L, tree.n, None if tree.is_chain else tuple(tree.parents))
            node_rows.append(list(range(len(ids), len(ids) + tree.n)))
            leaf_seg.append(None)
            segs.append(seg)
            seg_first.append(len(ids))
            ids += list(tree.tokens)
            pos += [L + d for d in seg.depths()]
            continue
        first, by_leaf = {}, {}
        for path in tree.paths():
            by_leaf[path[-1]] = len(segs)
            for d, node in enumerate(path):
                first.setdefault(node, len(ids) + d)
            segs.append(Segment(slot, L, len(path)))
            seg_first.append(len(ids))
            ids += [tree.tokens[n] for n in path]
            pos += range(L, L + len(path))
        node_rows.append([first[i] for i in range(tree.n)])
        leaf_seg.append(by_leaf)
    return segs, seg_first, ids, pos, node_rows, leaf_seg


def round_decisions(drafts: Drafts, plan: dict, out: RoundResult) -> dict:
    """What must agree across ranks after a round, for every request of it: the drafted trees,
    the verify budget, the accepted paths and the bonus tokens."""
    return {
        "drafted": [[int(x) for x in t.tokens] for t in drafts.trees],
        "budget": plan.get("budget"),
        "accept_lens": list(out.accept_lens),
        "paths": [list(p) for p in out.paths],
        "bonus": [int(t) for t in out.bonus],
    }


def NextNEngine(
    model,
    cache,
    topk: int,
    num_steps: int,
    num_draft_tokens: int,
    drafter_factory,
    generator: torch.Generator,
    device=None,
    sync=None,
) -> SpecEngine:
    """The NextN chain / tree engine (no planner: every tree node is verified)."""
    return SpecEngine(
        model,
        cache,
        drafter_factory,
        generator,
        device,
        sync=sync,
        topk=topk,
        num_steps=num_steps,
        num_draft_tokens=num_draft_tokens,
    )


def check_tree_shape(steps, topk, draft_tokens) -> None:
    """The final (SGLang-resolved) shape: steps drafts deep, topk children per leaf, draft_tokens
    verified nodes including the root."""
    if steps is None or steps < 1:
        raise ValueError(f"--speculative-num-steps {steps}: must be >= 1")
    if topk is None or topk < 1:
        raise ValueError(f"--speculative-eagle-topk {topk}: must be >= 1 (1 = chain, > 1 = tree)")
    most = 1 + topk + (steps - 1) * topk * topk  # the root + every candidate EAGLE records
    if topk == 1 and draft_tokens != steps + 1:
        raise ValueError(
            f"--speculative-num-draft-tokens {draft_tokens}: a chain (topk 1) verifies steps + 1 = {steps + 1} tokens"
        )
    if draft_tokens is not None and topk > draft_tokens - 1:
        raise ValueError(
            f"--speculative-eagle-topk {topk}: at most --speculative-num-draft-tokens - 1 = "
            f"{draft_tokens - 1} (the root's children must fit in the verified tokens)"
        )
    if draft_tokens is None or not 2 <= draft_tokens <= most:
        raise ValueError(
            f"--speculative-num-draft-tokens {draft_tokens}: with --speculative-num-steps {steps} and "
            f"--speculative-eagle-topk {topk} it must be in [2, {most}] (root + recorded candidates)"
        )
