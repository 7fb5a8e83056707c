"""NextN's round shape, chosen per round by the round cost surface: the configured tree, a chain,
or no draft at all (a plain decode step), so that a tree's extra acceptance is bought only where
it pays and speculation never costs more than it gives (issue #33; DSpark's planner.py does the
same for its verify budget).

For R requests, a round of shape s costs

    T_s(R) = t(R, R * m_s) + d_s(R)

t the round without its draft stage (cost.RoundCost over requests and verified rows, seeded at
startup by planner.measure_cost, refined online by cost.OnlineCost; under a captured verify priced
at the bucket's rows, cost.Padded), m_s the rows a request verifies in shape s (1 for plain,
steps + 1 for the chain, the tree's nodes: learned from the rounds), d_s the draft
stage's seconds (0 for plain; per shape, by batch size, the median of its last rounds, seeded at
startup). The round emits R * (1 + a_s) tokens, a_s the mean accepted drafts per request of the
shape's recent rounds (an exponential average). The round takes the shape of most tokens per
second; a shape not taken for `explore` rounds is taken once, so its figures stay current, and
each speculative shape is taken `first` times, in turn, before any choice: its acceptance is
unknown until then, and one round of one request is too noisy a figure (a tree whose first round
accepted nothing was priced at no acceptance and left for `explore` rounds: measured, the chain
ran 21 of 22 rounds at one request where the tree emits 15 % more).

Lossless: the shape is fixed from finished rounds' timings and acceptances before this round
drafts; given its shape a round is an ordinary NextN round (accept.py), so the choice can depend on
nothing the round draws. Every rank must take the same shape: acceptances are the same on every
rank (their decisions agree), and the timings every rank measures for itself are replaced by one
rank's at each refit (`agree`, spec_sync.RankSync.broadcast).
"""

from __future__ import annotations

import statistics
from collections import deque

import torch

from .cost import OnlineCost, Padded, interp
from .planner import batch_sizes, best_of, measure_cost

SHAPES = ("plain", "chain", "tree")


class ShapePlanner:
    def __init__(
        self, topk: int, steps: int, draft_tokens: int, explore: int = 32, every: int = 16, agree=None, first: int = 4
    ):
        self.geometry = {"plain": (1, 1), "chain": (1, steps + 1), "tree": (topk, draft_tokens)}
        self.shapes = [s for s in SHAPES if s != "tree" or topk > 1]
        self.configured = "tree" if topk > 1 else "chain"
        self.explore, self.every, self.agree, self.first = explore, every, agree, first
        # unknown until a round of the shape is seen (the first rounds take each shape once); the
        # tree verifies each node once (engine.verify_segments), rows learned from the rounds
        self.accepted = {"plain": 0.0, "chain": None, "tree": None}
        self.seen = dict.fromkeys(SHAPES, 0)
        self.rows = {"plain": 1.0, "chain": steps + 1.0, "tree": float(draft_tokens)}
        self.online = None  # OnlineCost of a round without its draft stage
        self.pad = None  # rows -> the rows the verify runs at (a captured bucket)
        self.drafts = {s: {} for s in self.shapes}  # shape -> R -> recent draft seconds
        self.table = {s: [] for s in self.shapes}  # shape -> [(R, draft seconds)], agreed
        self.since = dict.fromkeys(self.shapes, 0)
        self.rounds = 0
        self.last = {}

    def seed(self, cost, drafts: dict) -> None:
        """`cost`: a cost.RoundCost of rounds without drafting; `drafts`: shape -> [(R, seconds)]."""
        self.online = OnlineCost(cost, agree=self.agree)
        self.table = {s: sorted(drafts.get(s, ())) for s in self.shapes}

    def draft_seconds(self, shape: str, R: int) -> float:
        pts = self.table.get(shape) or []
        if shape == "plain" or not pts:
            return 0.0
        return interp([r for r, _ in pts], [t for _, t in pts], float(R))

    def predict(self, shape: str, R: int) -> float:
        cost = self.online.cost if self.pad is None else Padded(self.online.cost, self.pad)
        return cost(R, max(R, round(R * self.rows[shape]))) + self.draft_seconds(shape, R)

    def choose(self, R: int) -> str:
        if self.online is None:
            return self.configured
        unseen = sorted(  # in turn, the fewest seen first
            (s for s in self.shapes if s != "plain" and self.seen[s] < self.first), key=lambda s: self.seen[s]
        )
        tps = {s: R * (1.0 + (self.accepted[s] or 0.0)) / max(1e-9, self.predict(s, R)) for s in self.shapes}
        best = max(self.shapes, key=lambda s: (tps[s], s != "plain"))  # ties: speculate
        stale = unseen or [s for s in self.shapes if s != best and self.since[s] + 1 >= self.explore]
        shape = stale[0] if stale else best
        for s in self.shapes:
            self.since[s] = 0 if s == shape else self.since[s] + 1
        self.last = dict(
            shape=shape,
            explored=bool(stale),
            skipped_draft=shape == "plain",
            predicted_seconds=self.predict(shape, R),
            predicted_tokens_per_s={s: round(v, 2) for s, v in tps.items()},
        )
        return shape

    def describe(self) -> str:
        """What the last choice weighed: each shape's accepted drafts, rows a request and
        predicted tokens per second."""
        acc = " ".join(f"{s} {self.accepted[s] or 0.0:.2f}" for s in self.shapes if s != "plain")
        rows = " ".join(f"{s} {self.rows[s]:.1f}" for s in self.shapes)
        tps = self.last.get("predicted_tokens_per_s")
        return f"accepted drafts {acc}; rows/request {rows}; last predicted tok/s {tps}"

    def learn(self, shape: str, R: int, rows: int, accept_lens, seconds: float, draft_seconds: float) -> None:
        """A finished round: its shape, requests, verified rows, accept lengths (bonus included),
        wall seconds and its draft stage's seconds."""
        if self.online is None or not R:
            return
        self.seen[shape] += 1
        a = max(0.1, 1.0 / self.seen[shape])  # the mean of the first ten rounds, then an average
        if shape != "plain":
            prev = self.accepted[shape] if self.accepted[shape] is not None else 0.0
            self.accepted[shape] = prev + a * (sum(accept_lens) / R - 1.0 - prev)
            self.rows[shape] += a * (rows / R - self.rows[shape])
            self.drafts[shape].setdefault(R, deque(maxlen=9)).append(draft_seconds)
        rows = rows if self.pad is None else self.pad(rows)
        self.online.observe(R, rows, max(1e-9, seconds - draft_seconds), None)
        self.rounds += 1
        if self.rounds % self.every == 0:
            table = {
                s: sorted((R_, statistics.median(d)) for R_, d in self.drafts[s].items()) or self.table[s]
                for s in self.shapes
            }
            self.table = table if self.agree is None else self.agree(table)


def measure(engine, planner: ShapePlanner, max_requests: int, agree=None) -> tuple:
    """(round cost seed, draft table) for `planner.seed` on this machine: the round without its
    draft timed at each shape's rows per request (planner.measure_cost, through the engine's
    captured verify if any; `agree` as there), and each shape's draft stage (`measure_drafts`)."""
    ks = sorted({int(planner.rows[s]) for s in planner.shapes})
    seed = measure_cost(
        engine.model.model,
        engine.cache,
        ks[-1] - 1,
        max_requests=max_requests,
        agree=agree,
        graphs=engine.graphs,
        ks=ks,
    )
    return seed, measure_drafts(engine, planner, max_requests)


@torch.no_grad()
def measure_drafts(engine, planner: ShapePlanner, max_requests: int, start: int = 64) -> dict:
    """shape -> [(R, seconds of its draft stage)] for R in 1, 2, 4, ... <= max_requests: each
    shape's draft over R requests reading slot 0 (its writes discarded), best of two after a
    warm-up. The engine's shape is restored afterwards."""
    start = max(0, min(start, engine.cache.max_context_len - engine.num_steps - 2))
    kept = (engine.topk, engine.num_draft_tokens)
    out = {}
    try:
        for shape in planner.shapes:
            if shape == "plain":
                continue
            engine.topk, engine.num_draft_tokens = planner.geometry[shape]
            out[shape] = [
                (R, best_of(lambda: engine.drafter.draft([0] * R, [start] * R, [0] * R, [[0]] * R)))
                for R in batch_sizes(max_requests)
            ]
    finally:
        engine.topk, engine.num_draft_tokens = kept
    return out
