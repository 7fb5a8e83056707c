"""What one speculative round costs on this machine: the surface the DSpark planner trades verified
rows against (planner.py), seeded at startup, refined online from the rounds the server runs.

A round over R requests that verifies m rows (anchors included) costs

    t(R, m) = bias + alpha(R) + theta(m)                 seconds, drafting included
    t_plain(R) = t(R, R) - draft(R)                      the same step without drafting

alpha and theta piecewise linear over their probes, clamped outside them: SGLang's
`SpsAdditiveCostTable`, so its files load unchanged and for the same table our budget is SGLang's
`compute_verify_token_budget` (a differential test runs both). `draft(R)` is ours: the part of a
round that drafting takes, which a round that skips drafting saves (planner.Planner.decide).

Why a surface of the whole round and not the target forward alone: the draft, the planner, the
accept and the commit are paid every round whatever the budget, and on this CPU they are a third of
a round at batch 16; a model of the verify forward alone (the linear fit this file replaced) was off
by up to 1.7x there and could not see when drafting itself stops paying.

Three file formats load (`--speculative-dspark-sps-table-path`): SGLang's additive table
(`bias_seconds`, `bs_probes`, `alpha_seconds`, `m_probes`, `theta_seconds`, plus our optional
`draft_seconds`), SGLang's `SpsCostTable` (steps per second by batch tokens, floor lookup), and
`bench sps` output (`points`: [[R, m, seconds], ...], fitted here).
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

FLAG = "--speculative-dspark-sps-table-path"


def interp(xs, ys, x: float) -> float:
    """Piecewise-linear ys over xs at x, clamped to the end values (SGLang's `_interp_clamped`)."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    hi = bisect.bisect_right(xs, x)
    lo = hi - 1
    frac = (x - xs[lo]) / (xs[hi] - xs[lo])
    return ys[lo] + frac * (ys[hi] - ys[lo])


def hats(xs, x: float) -> list[float]:
    """The interpolation weights of x over probes xs: interp(xs, ys, x) == sum(w * y)."""
    w = [0.0] * len(xs)
    if x <= xs[0] or len(xs) == 1:
        w[0] = 1.0
    elif x >= xs[-1]:
        w[-1] = 1.0
    else:
        hi = bisect.bisect_right(xs, x)
        frac = (x - xs[hi - 1]) / (xs[hi] - xs[hi - 1])
        w[hi - 1], w[hi] = 1.0 - frac, frac
    return w


def probes_up_to(n: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 12, 16, ... up to and including n: about 1.5x apart, dense where small
    batches change the cost fastest."""
    out, p = [1], 2
    while p < n:
        out.append(p)
        p = p + 1 if p < 4 else (p * 3 // 2 if p & (p - 1) == 0 else p * 4 // 3)
    if out[-1] != n and n > 1:
        out.append(n)
    return out


@dataclass
class RoundCost:
    """t(R, m) = bias + alpha(R) + theta(m), and draft(R) (module docstring)."""

    bias: float
    bs_probes: list
    alpha: list
    m_probes: list
    theta_s: list
    draft_s: list | None = None  # over bs_probes; None: unknown until rounds measure it (OnlineCost)
    source: str = ""
    points: list = field(default_factory=list)  # measured [R, m, seconds] it was fitted to, if any
    draft_points: list = field(default_factory=list)  # measured [R, draft seconds]

    def __post_init__(self):
        for name, xs, ys in (("bs", self.bs_probes, self.alpha), ("m", self.m_probes, self.theta_s)):
            if not xs or list(xs) != sorted(set(xs)) or len(xs) != len(ys):
                raise ValueError(f"{name}_probes {xs}: must be strictly increasing, one value each, got {ys}")
        if self.draft_s is not None and len(self.draft_s) != len(self.bs_probes):
            raise ValueError(f"draft_seconds {self.draft_s}: one value per bs_probe {self.bs_probes}")
        if not self.bias > 0:
            raise ValueError(f"bias_seconds must be > 0, got {self.bias}")

    def __call__(self, requests: int, rows: int) -> float:
        return (
            self.bias
            + interp(self.bs_probes, self.alpha, float(requests))
            + interp(self.m_probes, self.theta_s, float(rows))
        )

    def draft(self, requests: int) -> float:
        return 0.0 if self.draft_s is None else max(0.0, interp(self.bs_probes, self.draft_s, float(requests)))

    def plain(self, requests: int) -> float:
        """A round that skips drafting and verifies the anchors only (a plain decode step)."""
        return max(1e-9, self(requests, requests) - self.draft(requests))

    def theta(self, requests: int, tau: torch.Tensor) -> torch.Tensor:
        """tau[k] / t(R, R + k) for k = 0.. len(tau) - 1, float64, computed in SGLang's order
        (`_additive_step_time_tensor`) so that equal tables give equal argmaxes."""
        floor = self.bias + interp(self.bs_probes, self.alpha, float(requests))
        m_probes = torch.tensor(self.m_probes, dtype=torch.float64)
        vals = torch.tensor(self.theta_s, dtype=torch.float64)
        m = (requests + torch.arange(tau.numel(), dtype=torch.float64)).clamp_(
            min=float(self.m_probes[0]), max=float(self.m_probes[-1])
        )
        if len(self.m_probes) == 1:
            at_m = vals[0].expand_as(m)
        else:
            hi = torch.bucketize(m, m_probes, right=True).clamp_(1, m_probes.numel() - 1)
            lo = hi - 1
            span = (m_probes[hi] - m_probes[lo]).clamp_(min=1e-9)
            at_m = vals[lo] + (m - m_probes[lo]) / span * (vals[hi] - vals[lo])
        return tau / (floor + at_m)

    def to_json(self) -> dict:
        out = {
            "bias_seconds": self.bias,
            "bs_probes": list(self.bs_probes),
            "alpha_seconds": list(self.alpha),
            "m_probes": list(self.m_probes),
            "theta_seconds": list(self.theta_s),
        }
        if self.draft_s is not None:
            out["draft_seconds"] = list(self.draft_s)
        if self.points:
            out["points"], out["draft_points"] = self.points, self.draft_points
        return out


@dataclass
class StepsTable:
    """SGLang's `SpsCostTable`: steps per second by batch tokens m = R + k (floor lookup). Its
    steps are whole rounds; it knows no drafting cost, so a round never skips drafting under it."""

    sample_batch_tokens: list
    sample_steps_per_sec: list
    source: str = ""

    def _sps(self, m: torch.Tensor) -> torch.Tensor:
        probes = torch.tensor(self.sample_batch_tokens, dtype=torch.int64)
        sps = torch.tensor(self.sample_steps_per_sec, dtype=torch.float64)
        idx = (torch.bucketize(m, probes, right=True) - 1).clamp_(0, probes.numel() - 1)
        return sps[idx]

    def __call__(self, requests: int, rows: int) -> float:
        return 1.0 / float(self._sps(torch.tensor([int(rows)]))[0])

    def draft(self, requests: int) -> float:
        return 0.0

    def plain(self, requests: int) -> float:
        return self(requests, requests)

    def theta(self, requests: int, tau: torch.Tensor) -> torch.Tensor:
        return tau * self._sps(requests + torch.arange(tau.numel(), dtype=torch.int64))


@dataclass
class Padded:
    """A cost surface as a round under captured graphs pays it: a verify of m rows runs at the rows
    of the smallest captured bucket that holds it (`pad(m)`, speculative/graphs.py), so rows up
    to the bucket cost nothing extra, and the budget that maximises tokens per second fills the
    bucket (ties of the surface go to the larger k there, since tau grows with every draft). The
    online learner is fed padded rows too (planner.Planner.observe), so `inner` is learned at the
    rows rounds actually run."""

    inner: object
    pad: object  # rows -> the rows the round runs at

    def __call__(self, requests: int, rows: int) -> float:
        return self.inner(requests, self.pad(rows))

    def draft(self, requests: int) -> float:
        return self.inner.draft(requests)

    def plain(self, requests: int) -> float:
        return max(1e-9, self(requests, requests) - self.draft(requests))

    def theta(self, requests: int, tau: torch.Tensor) -> torch.Tensor:
        t = [self(requests, requests + k) for k in range(tau.numel())]
        return tau / torch.tensor(t, dtype=torch.float64)


def fit(samples, bs_probes, m_probes, prior: RoundCost | None = None, ridge: float = 1e-3, source="") -> RoundCost:
    """The additive surface nearest to `samples` [(R, m, seconds, weight), ...] in weighted least
    squares, non-decreasing in R and in m (more requests or rows never cost less: the fit is over
    non-negative increments between probes, scipy's NNLS), pulled toward `prior` (or toward zero)
    by `ridge` relative to the data's weight: regions without samples keep the prior, and the
    model's one free constant (bias vs alpha vs theta) is fixed."""
    from scipy.optimize import nnls

    nb, nm = len(bs_probes), len(m_probes)
    if not samples:
        raise ValueError(f"cost surface {source}: no samples to fit")

    def cumulative(w):  # weights on values -> weights on increments (value_i = sum_{j<=i} inc_j)
        out, acc = [0.0] * len(w), 0.0
        for i in range(len(w) - 1, -1, -1):
            acc += w[i]
            out[i] = acc
        return out

    A = torch.tensor(
        [[1.0, *cumulative(hats(bs_probes, R)), *cumulative(hats(m_probes, m))] for R, m, _, _ in samples],
        dtype=torch.float64,
    )
    y = torch.tensor([t for _, _, t, _ in samples], dtype=torch.float64)
    sw = torch.tensor([w for *_, w in samples], dtype=torch.float64).sqrt()
    n = 1 + nb + nm
    x0 = torch.zeros(n, dtype=torch.float64)
    if prior is not None:

        def increments(vals):
            return [max(0.0, v - (vals[i - 1] if i else 0.0)) for i, v in enumerate(vals)]

        x0[0] = prior.bias
        x0[1 : 1 + nb] = torch.tensor(increments([interp(prior.bs_probes, prior.alpha, p) for p in bs_probes]))
        x0[1 + nb :] = torch.tensor(increments([interp(prior.m_probes, prior.theta_s, p) for p in m_probes]))
    lam = math.sqrt(ridge * float(sw.square().sum()))
    A2 = torch.cat([A * sw[:, None], lam * torch.eye(n, dtype=torch.float64)])
    y2 = torch.cat([y * sw, lam * x0])
    x, _ = nnls(A2.numpy(), y2.numpy(), maxiter=50 * n)
    x = x.tolist()
    alpha = list(itertools.accumulate(x[1 : 1 + nb]))
    theta = list(itertools.accumulate(x[1 + nb :]))
    bias = max(x[0], 1e-6)  # SGLang's table needs bias > 0
    draft = None if prior is None or prior.draft_s is None else [prior.draft(p) for p in bs_probes]
    return RoundCost(bias, list(bs_probes), alpha, list(m_probes), theta, draft, source=source)


def from_points(points, max_requests: int, max_rows: int, draft=None, source="") -> RoundCost:
    """The surface through measured points [(R, m, seconds), ...] (startup or `bench sps`), plus
    `draft` [(R, seconds), ...] measured for the draft step."""
    pts = [(float(r), float(m), float(t)) for r, m, t in points]
    if not pts or any(not (t > 0 and math.isfinite(t)) for *_, t in pts):
        raise ValueError(f"cost surface {source}: need measured points (requests, rows, seconds > 0), got {points}")
    bs = probes_up_to(max(max_requests, int(max(r for r, *_ in pts))))
    ms = probes_up_to(max(max_rows, int(max(m for _, m, _ in pts))))
    # few points: the ridge keeps the surface smooth between them (a near-linear prior)
    c = fit([(r, m, t, 1.0) for r, m, t in pts], bs, ms, ridge=1e-4, source=source)
    if draft:
        d = sorted((float(r), float(t)) for r, t in draft)
        c.draft_s = [interp([r for r, _ in d], [t for _, t in d], p) for p in bs]
    return c


def load(path: str, max_requests: int = 16, max_rows: int = 80):
    """A cost file in any of the three formats (module docstring); errors name the flag."""
    try:
        with open(path) as f:
            data = json.load(f)
        if "bias_seconds" in data:
            return RoundCost(
                float(data["bias_seconds"]),
                [int(x) for x in data["bs_probes"]],
                [float(x) for x in data["alpha_seconds"]],
                [int(x) for x in data["m_probes"]],
                [float(x) for x in data["theta_seconds"]],
                [float(x) for x in data["draft_seconds"]] if "draft_seconds" in data else None,
                source=path,
            )
        if "sample_batch_tokens" in data:
            xs, sps = [int(x) for x in data["sample_batch_tokens"]], [float(x) for x in data["sample_steps_per_sec"]]
            if not xs or xs != sorted(set(xs)) or len(xs) != len(sps) or min(sps) <= 0:
                raise ValueError("sample_batch_tokens strictly increasing, one steps_per_sec > 0 each")
            return StepsTable(xs, sps, source=path)
        return from_points(data["points"], max_requests, max_rows, data.get("draft_points"), source=path)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"{FLAG} {path}: expected SGLang's SpsAdditiveCostTable or SpsCostTable JSON, or "
            f'{{"points": [[requests, rows, seconds], ...]}} (bench sps writes it): {e!r}'
        ) from e


@dataclass
class OnlineCost:
    """The surface refined from the rounds themselves: each round's (R, m, seconds) and its draft
    stage's seconds go into per-cell rings (the last `keep` samples of that exact (R, m)); every
    `every` rounds, and early at the rounds in `early`, the surface is refitted to the cells'
    medians, pulled toward the seed. The early refits are there because a seed is one best-of-two
    timing of the verify stage and the draft taken at startup: it knows nothing of the round's
    other stages nor of the load the server runs under, and on this CPU it was 15-45 % below the
    rounds, which `every` rounds of waiting would have kept for the first 16 rounds of every
    batch size. A sample
    more than `outlier`x off the current prediction (a page fault, a GC pause, the first call of
    a shape) is counted and dropped, unless more than `every` of the last 2 * `every` rounds
    were that far off: then the surface is what is wrong (a seed measured on a loaded machine, a table from
    another one) and the samples are kept. Memory is bounded: at most `max_cells` cells, the
    least recently fed dropped first. `agree(cost) -> cost` makes every rank use the same refit (rank
    0's, spec_sync.RankSync.broadcast): ranks time their own rounds but must plan alike."""

    cost: RoundCost
    every: int = 16
    early: tuple = (4, 8)
    keep: int = 9
    outlier: float = 4.0
    max_cells: int = 512
    agree: object = None
    seed: RoundCost | None = None
    cells: OrderedDict = field(default_factory=OrderedDict)
    drafts: dict = field(default_factory=dict)
    rounds: int = 0
    dropped: int = 0
    refits: int = 0
    recent: deque = None  # whether each of the last 2 * every rounds was off the surface

    def __post_init__(self):
        self.seed = self.seed or self.cost
        self.recent = deque(maxlen=2 * self.every)

    def observe(self, requests: int, rows: int, seconds: float, draft_seconds: float | None) -> None:
        """One round: R requests, m verified rows, its wall seconds; the draft stage's seconds
        (None for a round that skipped drafting: its seconds plus the draft estimate stand for
        t(R, R))."""
        self.rounds += 1
        if draft_seconds is None:
            seconds += self.cost.draft(requests)
        pred = self.cost(requests, rows)
        off = not (pred / self.outlier <= seconds <= pred * self.outlier)
        self.recent.append(off)
        if not (seconds > 0 and math.isfinite(seconds)) or (off and 2 * sum(self.recent) <= self.recent.maxlen):
            self.dropped += 1
        else:
            key = (int(requests), int(rows))
            ring = self.cells.pop(key, None) or deque(maxlen=self.keep)
            ring.append(seconds)
            self.cells[key] = ring
            while len(self.cells) > self.max_cells:
                self.cells.popitem(last=False)
            if draft_seconds is not None and draft_seconds > 0:
                self.drafts.setdefault(int(requests), deque(maxlen=self.keep)).append(draft_seconds)
        if self.rounds % self.every == 0 or self.rounds in self.early:
            self.refit()

    def refit(self) -> None:
        """Every rank calls this on the same round (`every`), cells or not: `agree` is a
        collective, and which samples a rank kept is its own."""
        new = self.cost
        if self.cells:
            samples = [(R, m, _median(ring), len(ring)) for (R, m), ring in self.cells.items()]
            # the seed's probes plus the default grid up to what the rounds reached: a table from
            # elsewhere may probe coarsely (SGLang's [1, 64]) or stop short of this server's batches
            bs = _knots(self.seed.bs_probes, max(R for R, _ in self.cells))
            ms = _knots(self.seed.m_probes, max(m for _, m in self.cells))
            new = fit(samples, bs, ms, prior=self.seed, ridge=1e-3, source="online")
            if self.drafts:  # measured between the batch sizes seen, the seed's outside them
                d = sorted((R, _median(r)) for R, r in self.drafts.items())
                xs, ys = [r for r, _ in d], [t for _, t in d]
                new.draft_s = [interp(xs, ys, p) if xs[0] <= p <= xs[-1] else self.seed.draft(p) for p in new.bs_probes]
        self.cost = new if self.agree is None else self.agree(new)
        self.refits += 1


def _knots(probes, reached: int) -> list:
    return sorted({int(p) for p in probes} | set(probes_up_to(max(int(probes[-1]), int(reached)))))


def _median(xs) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else 0.5 * (s[len(s) // 2 - 1] + s[len(s) // 2])


def describe(cost) -> str:
    """One log line: the surface at the corners of the batch sizes it was fitted for."""
    if isinstance(cost, StepsTable):
        return f"SGLang SpsCostTable, {len(cost.sample_batch_tokens)} probes (no drafting cost: never skips drafting)"
    R = cost.bs_probes[-1]
    g = max(1, (cost.m_probes[-1] - R) // max(1, R))
    ms = lambda t: f"{t * 1e3:.2f}"  # noqa: E731
    return (
        f"t(R, m) = bias + alpha(R) + theta(m) ms: t(1, 1) {ms(cost(1, 1))}, t(1, {1 + g}) {ms(cost(1, 1 + g))}, "
        f"t({R}, {R}) {ms(cost(R, R))}, t({R}, {R * (1 + g)}) {ms(cost(R, R * (1 + g)))}; "
        f"drafting: {ms(cost.draft(1))} at 1, {ms(cost.draft(R))} at {R}"
        + ("" if cost.draft_s is not None else " (unknown until rounds measure it)")
    )
