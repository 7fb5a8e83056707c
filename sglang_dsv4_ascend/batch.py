"""The shared types of one forward, imported downward by the layers, the models, the caches
(kvcache/), the speculative engine and the SGLang backend; this module imports only torch.

A forward takes the new tokens of several requests concatenated; each request is a `Segment`:
its cache slot, how many of its tokens the cache already holds (`start`) and how many are new.
Full prefill (start=0), chunked prefill, decode (length 1), speculative verify and mixtures of
them all go through the same path. Each attention layer computes the cache rows and entries its
segments add, as `SegmentWrites` (per segment) or `LayerWrites` (a batched forward: every row at
once, stored through the forward's plan, kvcache/plan.py); the cache stores them
(`DSV4Cache.write` / `store_layer`) at once or, for a speculative verify, only the accepted prefix
later (`DSV4Cache.apply`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segment:
    """One request's new tokens in a forward: cache `slot`, `start` = position of its first new token
    (= tokens already in its cache, the committed length), `length` = number of new tokens.

    `parents` (a speculative verify's draft tree, node-once): the new tokens are the nodes of a
    tree, parents before children (parents[0] = -1, the root at `start`; a draft step's forest has
    several roots); node i sits at position start + depth(i) and sees the cache and its own
    ancestors only, never a sibling's branch. None: a chain, token i at start + i (every other
    forward).

    `past` (a NextN draft step, incremental): the tree's first len(past) nodes were computed by an
    earlier forward of the same round; their keys are rows past[i] of the plan's `past_kv`, and
    only the remaining `length` nodes are this forward's tokens (parents covers both)."""

    slot: int
    start: int
    length: int
    parents: tuple | None = None
    past: tuple = ()

    def node_depths(self) -> list[int]:
        """Every node's offset from `start` (its depth in the tree), past nodes included."""
        if self.parents is None:
            return list(range(self.length))
        d = []
        for p in self.parents:
            d.append(0 if p < 0 else d[p] + 1)
        return d

    def depths(self) -> list[int]:
        """Each new token's offset from `start`."""
        return self.node_depths()[len(self.past) :]

    def ancestors(self, i: int) -> list[int]:
        """Node i's root-to-node path (indices among the segment's tokens)."""
        if self.parents is None:
            return list(range(i + 1))
        path = [i]
        while self.parents[path[-1]] >= 0:
            path.append(self.parents[path[-1]])
        return path[::-1]


@dataclass
class DSV4ForwardMetadata:
    """What the SGLang attention backend (attention_backend/backend.py) hands the SGLang model
    (models/deepseek_v4.py) for one forward."""

    segments: list  # [Segment], in token order
    plan: object = None  # kvcache/plan.py ForwardPlan, built once per forward (batched path)


COMPRESSOR = "compressor"  # the layer's main KV compressor (CSA or HCA)
INDEXER = "indexer"  # the CSA lightning indexer's own compressor


@dataclass
class SegmentWrites:
    """What one layer produced for one segment: rows keyed by position, entries by entry number."""

    layer: int
    slot: int
    start: int
    length: int
    ratio: int
    swa: torch.Tensor  # [length, head_dim], positions start..start+length-1
    rows: dict = field(default_factory=dict)  # name -> (kv [length, C], gate [length, C])
    entries: dict = field(default_factory=dict)  # name -> (first entry number j0, [m, dim])
    seg: int = 0  # the segment's index in its forward (for `apply(..., keep=)`)

    def prefix(self, n: int) -> "SegmentWrites":
        """Keep the first n positions (the accepted ones) and the entries they complete."""
        n = max(0, min(n, self.length))
        entries = {}
        for name, (j0, e) in self.entries.items():
            complete = (self.start + n) // self.ratio  # entries j < this are complete
            entries[name] = (j0, e[: max(0, complete - j0)])
        rows = {k: (kv[:n], g[:n]) for k, (kv, g) in self.rows.items()}
        return SegmentWrites(self.layer, self.slot, self.start, n, self.ratio, self.swa[:n], rows, entries, self.seg)


@dataclass
class LayerWrites:
    """What one layer of a batched forward produced: rows of every query row (in plan order) and
    the entries the forward completed (kvcache/plan.py RatioPlan numbering). The cache stores them
    through the plan's host-computed lists (`DSV4Cache.store_layer`), optionally keeping only
    accepted prefixes."""

    layer: int
    plan: object
    swa: torch.Tensor  # [T, head_dim]
    rows: dict = field(default_factory=dict)  # name -> (kv [T, C], gate [T, C])
    entries: dict = field(default_factory=dict)  # name -> [E, dim]
