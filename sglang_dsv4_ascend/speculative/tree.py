"""Draft trees and their incremental EAGLE construction.

A `DraftTree` is what one verify pass checks: node 0 is the root (the last committed but not yet
verified token, i.e. the previous round's bonus token), every other node is a drafted token whose
parent has a lower index. Node order is also the verify row order, and among the children of one
node ascending index is the sibling order the accept rules walk.

`TreeBuilder` reproduces SGLang's EAGLE scheme (`select_top_k_tokens` in speculative/spec_utils.py,
`organize_draft_results` in speculative/eagle_utils.py) one draft step at a time, because the worker
runs the drafter step by step and feeds each step's leaves back in.

Ties. SGLang ranks with `torch.topk`, whose order among equal values is unspecified. Here every
ranking is by (-value, index): on equal probability the lower token id wins, on equal score the
lower candidate id wins. The candidate rule is what keeps a tree closed under parents: a child's
score is parent_score * child_prob <= parent_score (also after fp32 rounding, which is monotone),
and the parent's candidate id is lower, so the parent always outranks its child.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["DraftTree", "TreeBuilder", "topk_stable"]


def _root_path(parents, i: int) -> list[int]:
    """i and its ancestors (parents[...] == -1 ends the walk), topmost first."""
    out = []
    while i != -1:
        out.append(i)
        i = parents[i]
    return out[::-1]


@dataclass(frozen=True)
class DraftTree:
    """A draft tree in topological order.

    tokens[i] is node i's token; parents[0] == -1 and 0 <= parents[i] < i for i > 0. Lists are
    accepted and stored as tuples of ints (the tree is hashable and immutable).
    """

    tokens: tuple[int, ...]
    parents: tuple[int, ...]

    def __post_init__(self):
        tokens = tuple(int(t) for t in self.tokens)
        parents = tuple(int(p) for p in self.parents)
        if not tokens:
            raise ValueError("DraftTree needs at least the root node")
        if len(tokens) != len(parents):
            raise ValueError(f"DraftTree has {len(tokens)} tokens but {len(parents)} parents")
        if parents[0] != -1:
            raise ValueError(f"DraftTree root must have parent -1, got {parents[0]}")
        for i, p in enumerate(parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"DraftTree node {i} has parent {p}; need 0 <= parent < {i}")
        for i, t in enumerate(tokens):
            if t < 0:
                raise ValueError(f"DraftTree node {i} has negative token {t}")
        # frozen: the coerced tuples must bypass the dataclass __setattr__
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "parents", parents)

    @property
    def n(self) -> int:
        """Number of nodes, root included."""
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """One node per depth (no branching): in topological order each node's parent is the one
        before it."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depth(self) -> tuple[int, ...]:
        """Depth of every node; the root has depth 0."""
        d = [0] * self.n
        for i in range(1, self.n):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    def children(self, i: int) -> list[int]:
        """Children of node i in sibling order (ascending node index)."""
        return [j for j in range(i + 1, self.n) if self.parents[j] == i]

    def leaves(self) -> list[int]:
        """Nodes without children, ascending. A single-node tree's only leaf is the root."""
        has_child = set(self.parents[1:])
        return [i for i in range(self.n) if i not in has_child]

    def path(self, i: int) -> list[int]:
        """Node indices from the root to node i, both included."""
        if not 0 <= i < self.n:
            raise IndexError(f"node {i} not in a tree of {self.n} nodes")
        return _root_path(self.parents, i)

    def paths(self) -> list[list[int]]:
        """path(leaf) for every leaf, in leaves() order."""
        return [self.path(leaf) for leaf in self.leaves()]

    def positions(self, L: int) -> list[int]:
        """Sequence position of every node when the root sits at position L."""
        return [L + d for d in self.depth()]

    def ancestor_mask(self) -> torch.Tensor:
        """[n, n] bool; [i, j] is True iff j is an ancestor of i or j == i (the verify attention
        mask among the tree's own rows)."""
        mask = torch.zeros(self.n, self.n, dtype=torch.bool)
        mask[0, 0] = True
        for i in range(1, self.n):
            mask[i] = mask[self.parents[i]]  # parents come first, so their row is complete
            mask[i, i] = True
        return mask

    @classmethod
    def chain(cls, tokens) -> "DraftTree":
        """A linear tree: node i's parent is i - 1."""
        tokens = tuple(int(t) for t in tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))


def topk_stable(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k along the last dim ranked by (-value, index): values descending, equal values lower
    index first. Returns (values, indices), each [..., k], in that rank order.

    torch.topk is used for speed but its tie order is unspecified, so the k kept entries are
    re-ranked, and rows where more entries tie with the k-th value than fit (so topk's choice of
    which to keep is itself arbitrary) are redone with a stable full sort.
    """
    if not 0 < k <= x.shape[-1]:
        raise ValueError(f"top-{k} of {x.shape[-1]} values")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    vals, idx = torch.topk(x2, k, dim=-1)
    by_index = torch.argsort(idx, dim=-1)
    idx, vals = idx.gather(-1, by_index), vals.gather(-1, by_index)
    by_value = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    idx, vals = idx.gather(-1, by_value), vals.gather(-1, by_value)
    cut_tied = (x2 >= vals[:, -1:]).sum(-1) > k
    if cut_tied.any():
        s_vals, s_idx = torch.sort(x2[cut_tied], dim=-1, descending=True, stable=True)
        vals[cut_tied], idx[cut_tied] = s_vals[:, :k], s_idx[:, :k]
    return vals.reshape(*lead, k), idx.reshape(*lead, k)


class TreeBuilder:
    """EAGLE tree construction (SGLang `select_top_k_tokens` / `organize_draft_results`), one request.

    step 0: the top-K tokens of the root's draft distribution, score = prob -> K leaves.
    step s >= 1: for each current leaf its top-K children -> K*K candidates with cumulative score
      parent_score * child_prob (fp32); the best K by score become the new leaves, ranked best
      first. Every candidate of every step is recorded.
    finish(N): the N-1 highest-scoring recorded candidates (ties: lower candidate id), sorted by
      candidate id (parents before children), with the root prepended.

    Candidate ids follow recording order, which is SGLang's layout: step 0 gives ids 0..K-1 in rank
    order; step s >= 1 gives ids K + K*K*(s-1) + j*K + r to the r-th ranked child of the j-th
    leaf. Leaves are ordered by (-score, id) as SGLang's topk returns them, and the caller must
    feed the next step's probability rows in that order.
    """

    def __init__(self, root_token: int, topk: int):
        if topk < 1:
            raise ValueError(f"topk must be >= 1, got {topk}")
        self.root_token = int(root_token)
        self.topk = int(topk)
        self._tokens: list[int] = []  # per candidate
        self._parents: list[int] = []  # parent candidate id, -1 for depth 1
        self._scores: list[torch.Tensor] = []  # fp32, one tensor per step, in id order
        self._leaves: list[int] = []
        self._leaf_scores: torch.Tensor | None = None

    @property
    def num_candidates(self) -> int:
        """Candidates recorded so far (K after step 0, K + K*K*s after step s)."""
        return len(self._tokens)

    def step(self, probs: torch.Tensor) -> list[int]:
        """Record one draft step and return the new leaves' candidate ids (best first).

        probs: [len(leaves), V] draft probabilities, row j for the j-th leaf returned by the
        previous step; [1, V] for the root at step 0.
        """
        k = self.topk
        first = self._leaf_scores is None
        rows = 1 if first else len(self._leaves)
        if probs.dim() != 2 or probs.shape[0] != rows:
            raise ValueError(f"step expects probs of shape [{rows}, V], got {tuple(probs.shape)}")
        if probs.shape[1] < k:
            raise ValueError(f"vocabulary of {probs.shape[1]} is smaller than topk={k}")
        child_p, child_tok = topk_stable(probs.float(), k)  # [rows, k]
        base = self.num_candidates
        if first:
            scores = child_p[0]
            parents = [-1] * k
            new_scores, pick = scores, torch.arange(k)
        else:
            scores = (self._leaf_scores[:, None] * child_p).flatten()
            parents = [leaf for leaf in self._leaves for _ in range(k)]
            new_scores, pick = topk_stable(scores, k)
        self._tokens.extend(child_tok.flatten().tolist())
        self._parents.extend(parents)
        self._scores.append(scores)
        self._leaves = [base + int(j) for j in pick]
        self._leaf_scores = new_scores
        return list(self._leaves)

    def cands_of(self, cand: int) -> list[int]:
        """Candidate ids from depth 1 down to cand."""
        if not 0 <= cand < self.num_candidates:
            raise IndexError(f"candidate {cand} not recorded ({self.num_candidates} so far)")
        return _root_path(self._parents, cand)

    def parent_of(self, cand: int) -> int:
        """The candidate cand was drafted from, -1 for the root's children (depth 1)."""
        return self._parents[cand]

    def token_of(self, cand: int) -> int:
        return self._tokens[cand]

    def tokens_of(self, cand: int) -> list[int]:
        """Token path from depth 1 down to cand (root excluded): the drafter's new context."""
        return [self._tokens[c] for c in self.cands_of(cand)]

    def finish(self, num_draft_tokens: int) -> tuple[DraftTree, list[int]]:
        """The tree of num_draft_tokens nodes (root included) and, for each node i >= 1, its
        candidate id (at index i - 1). Does not change the builder's state."""
        m = num_draft_tokens - 1
        if m < 0:
            raise ValueError(f"num_draft_tokens must be >= 1, got {num_draft_tokens}")
        if m > self.num_candidates:
            raise ValueError(
                f"num_draft_tokens={num_draft_tokens} needs {m} candidates, only {self.num_candidates} recorded"
            )
        if m == 0:
            return DraftTree((self.root_token,), (-1,)), []
        _, pick = topk_stable(torch.cat(self._scores), m)
        cands = sorted(int(c) for c in pick)
        node_of = {c: i for i, c in enumerate(cands, start=1)}
        # a parent outranks its child (see module docstring), so node_of always has it
        parents = [-1] + [0 if self._parents[c] == -1 else node_of[self._parents[c]] for c in cands]
        tokens = [self.root_token] + [self._tokens[c] for c in cands]
        return DraftTree(tuple(tokens), tuple(parents)), cands
