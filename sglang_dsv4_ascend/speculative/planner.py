"""DSpark verify planning (reference §2.6): how many of each request's gamma drafts the target
verifies this round.

static    every request verifies its whole block (gamma drafts + the anchor row).
adaptive  DSpark's production scheduler:
  1. budget K (extra draft rows for the whole batch) from the confidences recorded LAG (2) rounds
     earlier: with s = those survivals (cumulative products, >= eps) sorted descending and S_k
     their prefix sums, K = argmax_k (R + S_k) / t(R, R + k), t = the verify cost model
     (CostModel: seconds of a target forward over R requests and R + k rows); ties -> smaller k.
     A request with no record of its own from LAG rounds ago counts survival 1 everywhere.
     Without a cost model there is nothing to trade against, and K = R * gamma (verify all).
  2. selection: the K candidates (r, j) of highest CURRENT survival a_{r,j} = prod_{i<=j} c_{r,i},
     ranked by (a descending, j ascending, r ascending), a >= eps. Request r verifies
     l_r = #selected of its own, always its anchor row on top; since a_{r,.} is non-increasing and
     ties prefer the smaller j, the selected positions are a prefix.

Why this is lossless. Rejection sampling reproduces the target only if the decision to verify draft
x_{r,j} does not depend on x_{r,j} itself. c_{r,j} depends on x_{r,j-1} (the confidence head reads
W1[x_{j-1}]), so a_{r,j+1} depends on x_{r,j}. K is computed from survivals fixed before this
round's draws, and in the ranking every candidate (r, j') with j' > j sits below (r, j) (a_{r,j'} <=
a_{r,j}, ties to the smaller j), so whether (r, j) is among the top K depends only on x_{r,<j} and
on other requests' independent draws. A budget computed from the current confidences breaks this
(`broken_budget_from_current` in the tests): with a tight budget x_{r,j} is then verified more
often when it makes a_{r,j+1} high, which biases the output.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field

import torch

from .. import settings
from ..batch import Segment

EPS = 1e-6
LAG = 2


def verify_mode() -> str:
    """The DSpark verify mode (static | adaptive) from SGLANG_DSV4_DSPARK_VERIFY. SGLang's own
    SGLANG_RAGGED_VERIFY_MODE drives its CUDA worker's relay buffers and is left alone."""
    return settings.DSPARK_VERIFY.get()


@dataclass
class CostModel:
    """t(R, B) = c0 + c_req * R + c_tok * B seconds for a verify forward of R requests and B rows,
    least-squares fitted (coefficients >= 0) on measured points [(R, B, seconds), ...]."""

    c0: float
    c_req: float
    c_tok: float
    points: list = field(default_factory=list)
    source: str = ""

    def __call__(self, requests: int, rows: int) -> float:
        return self.c0 + self.c_req * requests + self.c_tok * rows

    @classmethod
    def fit(cls, points, source: str = "") -> "CostModel":
        pts = [(float(r), float(b), float(t)) for r, b, t in points]
        if len(pts) < 1 or any(not (t > 0 and math.isfinite(t)) for _, _, t in pts):
            raise ValueError(f"cost model {source}: need measured points (requests, rows, seconds > 0), got {points}")
        A = torch.tensor([[1.0, r, b] for r, b, _ in pts], dtype=torch.float64)
        y = torch.tensor([t for *_, t in pts], dtype=torch.float64)
        active = [0, 1, 2]
        while True:  # non-negative least squares by dropping negative terms (3 unknowns)
            sol = torch.linalg.lstsq(A[:, active], y[:, None]).solution.flatten().tolist()
            if min(sol) >= 0 or len(active) == 1:
                break
            active.pop(min(range(len(active)), key=lambda i: sol[i]))
        coef = [0.0, 0.0, 0.0]
        for i, c in zip(active, sol):
            coef[i] = max(0.0, c)
        if coef == [0.0, 0.0, 0.0]:
            coef[0] = min(t for *_, t in pts)
        return cls(*coef, points=[list(p) for p in points], source=source)

    def to_json(self) -> dict:
        return {
            "model": "t = c0 + c_req*requests + c_tok*rows",
            "c0": self.c0,
            "c_req": self.c_req,
            "c_tok": self.c_tok,
            "points": self.points,
        }

    @classmethod
    def load(cls, path: str) -> "CostModel":
        """A file written by `python -m sglang_dsv4_ascend.bench sps` ({"points": [[R, B, s], ...]})."""
        try:
            with open(path) as f:
                data = json.load(f)
            return cls.fit(data["points"], source=path)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(
                f"--speculative-dspark-sps-table-path {path}: expected "
                f'{{"points": [[requests, rows, seconds], ...]}} (bench sps writes it): {e!r}'
            ) from e


def survival(conf: torch.Tensor) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} c_{r,i}, float64 [R, gamma] (monotone: c in [0, 1])."""
    return torch.cumprod(conf.to(torch.float64).clamp(0.0, 1.0), dim=-1)


def budget(lagged_survival: torch.Tensor, cost: CostModel | None) -> int:
    """K from lagged survivals [R, gamma] (rows of requests without a record are all ones)."""
    R, gamma = lagged_survival.shape
    if cost is None:
        return R * gamma
    s = lagged_survival.flatten()
    s = torch.sort(s[s >= EPS], descending=True).values
    tau = R + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(s, 0)])
    k = torch.arange(len(tau), dtype=torch.float64)
    theta = tau / torch.tensor([cost(R, R + int(i)) for i in k.tolist()], dtype=torch.float64)
    return int(torch.argmax(theta).item())  # first maximum: the smaller k on ties


def select(current_survival: torch.Tensor, K: int) -> list[int]:
    """l_r per request: drafts verified, the top-K candidates by (a desc, j asc, r asc), a >= eps."""
    R, gamma = current_survival.shape
    flat = current_survival.flatten().tolist()
    cands = [(-flat[r * gamma + j], j, r) for r in range(R) for j in range(gamma) if flat[r * gamma + j] >= EPS]
    cands.sort()
    lens = [0] * R
    for _, _, r in cands[: max(0, K)]:
        lens[r] += 1
    return lens


class Planner:
    """Per-round verify lengths for a batch; keeps the lag ring of confidences per request slot.

    `plan(slots, gens, conf)`: conf [R, gamma] this round's confidences (None: no confidence head,
    only static is possible); gens[i] identifies the request occupying slot slots[i] (a new request
    in a reused slot must not inherit its predecessor's record). Returns l_r per request and
    records conf for LAG rounds later."""

    def __init__(self, gamma: int, mode: str = "adaptive", cost: CostModel | None = None, lag: int = LAG):
        if mode not in settings.DSPARK_VERIFY.choices:
            raise ValueError(
                f"{settings.DSPARK_VERIFY.name}={mode!r}: expected one of {', '.join(settings.DSPARK_VERIFY.choices)}"
            )
        self.gamma, self.mode, self.cost, self.lag = gamma, mode, cost, lag
        self.round = 0
        self.history = {}  # slot -> {round: (gen, conf row)}
        self.last = {}  # diagnostics of the last plan: K, predicted tokens/s

    def lagged(self, slots, gens) -> torch.Tensor:
        out = torch.ones(len(slots), self.gamma, dtype=torch.float64)
        for i, (slot, gen) in enumerate(zip(slots, gens)):
            rec = self.history.get(slot, {}).get(self.round - self.lag)
            if rec is not None and rec[0] == gen and len(rec[1]) == self.gamma:
                out[i] = survival(rec[1])
        return out

    def plan(self, slots, gens, conf: torch.Tensor | None) -> list[int]:
        R = len(slots)
        current = None if conf is None else survival(conf)
        if self.mode == "static" or conf is None or self.cost is None:
            lens = [self.gamma] * R
            K = R * self.gamma
        else:
            K = budget(self.lagged(slots, gens), self.cost)
            lens = select(current, K)
            for slot, gen, row in zip(slots, gens, conf.detach().to("cpu", torch.float64)):
                h = self.history.setdefault(slot, {})
                h[self.round] = (gen, row)
                for old in [r for r in h if r <= self.round - self.lag]:
                    del h[old]
        rows = R + sum(lens)
        self.last = dict(budget=K, rows=rows)
        if self.cost is not None and conf is not None:
            expected = R + sum(float(current[i, :n].sum()) for i, n in enumerate(lens))
            self.last.update(expected_tokens=expected, predicted_seconds=self.cost(R, rows))
        self.round += 1
        return lens


def measure_cost(
    trunk, cache, gamma: int, max_requests: int = 16, budget_s: float = 3.0, start: int = 64, agree=None
) -> CostModel:
    """The verify cost model of this machine: timed target forwards over R requests of k rows
    (R in 1, 2, 4, ... <= max_requests; k in 1, gamma // 2 + 1, gamma + 1), writes deferred and
    dropped (the cache is not touched), one untimed warm-up each, best of two; stops once
    `budget_s` is spent. Slot 0 is read for every request: its contents do not change the cost.
    `agree(flag) -> bool`: under TP the forwards hold collectives, so every rank must stop after the
    same point: the stop is true everywhere once it is true on one rank (spec_sync.RankSync.any)."""
    start = max(0, min(start, cache.max_context_len - gamma - 2))
    Rs = [1]
    while Rs[-1] * 2 <= max(1, max_requests):
        Rs.append(Rs[-1] * 2)
    ks = sorted({1, gamma // 2 + 1, gamma + 1})
    points, t_begin = [], time.perf_counter()
    dev = cache.device if cache.device is not None else "cpu"
    for R, k in ((R, k) for R in Rs for k in ks):
        segs = [Segment(0, start, k)] * R
        ids = torch.zeros(R * k, dtype=torch.long, device=dev)
        pos = torch.arange(start, start + k, device=dev).repeat(R)
        best = None
        for rep in range(3):
            t0 = time.perf_counter()
            trunk(ids, pos, segs, cache, pending=[])
            dt = time.perf_counter() - t0
            if rep:
                best = dt if best is None else min(best, dt)
        points.append((R, R * k, best))
        spent = time.perf_counter() - t_begin > budget_s
        if agree(spent) if agree is not None else spent:
            break
    return CostModel.fit(points, source=f"measured at startup, {len(points)} points")
