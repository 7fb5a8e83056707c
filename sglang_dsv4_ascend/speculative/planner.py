"""DSpark verify planning (reference §2.6): how many of each request's gamma drafts the target
verifies this round.

static    every request verifies its whole block (gamma drafts + the anchor row).
adaptive  DSpark's production scheduler:
  1. budget K (extra draft rows for the whole batch) from the confidences recorded LAG (2) rounds
     earlier: with s = those survivals (cumulative products, >= eps) sorted descending and S_k
     their prefix sums, K = argmax_k (R + S_k) / t(R, R + k), t = the round cost surface
     (cost.py: seconds of a whole round over R requests verifying R + k rows, refined online);
     ties -> smaller k. A request's record is its latest from a round <= now - LAG; one with none
     counts survival 1 everywhere. Without a cost model there is nothing to trade against, and
     K = R * gamma (verify all). When R / t_plain(R) >= (R + S_K) / t(R, R + K) the round does not
     draft at all (Planner.decide): speculation is then never slower than plain decoding, by the
     model's own prediction. Under a captured verify (speculative/graphs.py) t is priced at the
     rows the round runs at, its bucket's (cost.Padded): the budget is rounded up to fill the
     bucket, whose padding rows would cost the same and verify nothing. The bucket is a function
     of R and k alone, so this changes nothing below.
  2. selection: the K candidates (r, j) of highest CURRENT survival a_{r,j} = prod_{i<=j} c_{r,i},
     ranked by (a descending, j ascending, r ascending), a >= eps. Request r verifies
     l_r = #selected of its own, always its anchor row on top; since a_{r,.} is non-increasing and
     ties prefer the smaller j, the selected positions are a prefix.
  Every c above, lagged or current, is first calibrated (`Calibration`: a logit offset per draft
  position learned from finished rounds' accepts), so a biased confidence head does not make the
  planner verify too little or too much.

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

import time
from collections import deque
from dataclasses import dataclass

import torch

from .. import settings
from ..batch import Segment
from .cost import OnlineCost, Padded, RoundCost, from_points

EPS = 1e-6
LAG = 2


def verify_mode() -> str:
    """The DSpark verify mode (static | adaptive) from SGLANG_DSV4_DSPARK_VERIFY. SGLang's own
    SGLANG_RAGGED_VERIFY_MODE drives its CUDA worker's relay buffers and is left alone."""
    return settings.DSPARK_VERIFY.get()


def survival(conf: torch.Tensor) -> torch.Tensor:
    """a_{r,j} = prod_{i<=j} c_{r,i}, float64 [R, gamma] (monotone: c in [0, 1])."""
    return torch.cumprod(conf.to(torch.float64).clamp(0.0, 1.0), dim=-1)


def budget(lagged_survival: torch.Tensor, cost) -> int:
    """K from lagged survivals [R, gamma] (rows of requests without a record are all ones)."""
    return _best(lagged_survival, cost)[0]


def _best(lagged_survival: torch.Tensor, cost) -> tuple[int, float | None]:
    """(K, tokens per second at K). `cost`: a cost.RoundCost / StepsTable (their `theta`, SGLang's
    arithmetic), any callable t(R, rows), or None (verify everything)."""
    R, gamma = lagged_survival.shape
    if cost is None:
        return R * gamma, None
    s = lagged_survival.flatten()
    s = torch.sort(s[s >= EPS], descending=True).values
    tau = R + torch.cat([torch.zeros(1, dtype=torch.float64), torch.cumsum(s, 0)])
    if hasattr(cost, "theta"):
        theta = cost.theta(R, tau)
    else:
        theta = tau / torch.tensor([cost(R, R + k) for k in range(len(tau))], dtype=torch.float64)
    k = int(torch.argmax(theta).item())  # first maximum: the smaller k on ties
    return k, float(theta[k])


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


def observed(verified: int, accepted: int) -> range:
    """The draft positions (0-based) a request's round tested: verified, and every earlier draft
    accepted. Position k was accepted iff k < accepted."""
    return range(min(verified, accepted + 1))


class Calibration:
    """Per-position confidence calibration learned from the rounds' own outcomes: c' =
    sigmoid(logit(c) + b_k) at draft position k. A confidence head can be biased in a way its
    shipped temperatures cannot fix: the trained tiny model's head says 0.52 where 0.73-0.85 of
    drafts are accepted (its dspark_sts.json), and temperatures only pull toward 0.5. With
    survivals that low the planner verified about half of what static verify accepts.

    Observations: a request whose round verified l drafts and accepted a of them saw position k
    (0-based) iff k < l and every earlier draft was accepted (k <= a), and accepted it iff k < a:
    the conditional acceptance the survival product is made of. Each position keeps its last
    `keep` (logit c, accepted) pairs; every `every` learned rounds b_k is refitted (an offset-only
    logistic regression, Newton steps) toward the previous position's offset with `prior`
    pseudo-observations, so a position the planner rarely verifies borrows from the one before it.
    Lossless: b is learned from finished rounds only, and c -> c' is monotone per position and
    stays in (0, 1), so survivals stay non-increasing along each block (planner docstring)."""

    def __init__(self, gamma: int, keep: int = 1024, every: int = 16, prior: float = 8.0, agree=None):
        self.every, self.prior, self.agree = every, prior, agree
        self.obs = [deque(maxlen=keep) for _ in range(gamma)]
        self.shift = torch.zeros(gamma, dtype=torch.float64)
        self.rounds = 0

    def apply(self, conf: torch.Tensor) -> torch.Tensor:
        c = conf.to(torch.float64).clamp(0.0, 1.0)
        if not bool(self.shift.any()):  # nothing learned yet: the head's own confidences, exactly
            return c
        return torch.sigmoid(torch.logit(c) + self.shift[: c.shape[-1]])  # 0 and 1 stay put

    def learn(self, conf: torch.Tensor, verified, accepted) -> None:
        """conf [R, gamma] this round's raw confidences; verified[r], accepted[r]: drafts."""
        z = torch.logit(conf.to(torch.float64).clamp(EPS, 1.0 - EPS)).tolist()
        for r, (l, a) in enumerate(zip(verified, accepted)):
            for k in observed(l, a):
                self.obs[k].append((z[r][k], k < a))
        self.rounds += 1
        if self.rounds % self.every == 0:
            self.refit()

    def refit(self) -> None:
        shift, prev = [], 0.0
        for obs in self.obs:
            b = prev
            if obs:
                z = torch.tensor([o[0] for o in obs], dtype=torch.float64)
                y = torch.tensor([float(o[1]) for o in obs], dtype=torch.float64)
                for _ in range(8):
                    p = torch.sigmoid(z + b)
                    grad = float((y - p).sum()) - self.prior * (b - prev)
                    hess = float((p * (1 - p)).sum()) + self.prior
                    b += grad / hess
            shift.append(max(-8.0, min(8.0, b)))
            prev = shift[-1]
        new = torch.tensor(shift, dtype=torch.float64)
        self.shift = new if self.agree is None else self.agree(new)


@dataclass
class Decision:
    """What the planner decides before a round drafts: the budget K and whether to draft at all."""

    budget: int
    skip: bool = False
    spec_tps: float | None = None  # predicted tokens/s of the round at K
    plain_tps: float | None = None  # predicted tokens/s of a round without drafting


class Planner:
    """Per-round verify lengths for a batch; keeps the lag ring of confidences per request slot.

    `decide(slots, gens)` before drafting: K from the lagged survivals and the cost surface, and
    whether the round drafts at all (adaptive with a cost surface that knows drafting's cost: a
    round skips drafting when R / t_plain(R) >= tau_K / t(R, R + K), i.e. when the expected
    tokens per second of verifying K drafts do not pay for the draft step; every `explore`-th
    consecutive skip drafts anyway so the records stay current). Every input is fixed before this
    round's draws, so skipping is lossless like K itself: the round is then a plain decode step
    (anchors only) and the draft state is extended as after any round.
    `plan(slots, gens, conf, decision)`: conf [R, gamma] this round's confidences (None: no
    confidence head, or the round skipped drafting); gens[i] identifies the request occupying slot
    slots[i] (a new request in a reused slot must not inherit its predecessor's record). Returns
    l_r per request and records conf. A request's lagged record is its latest from round <= now -
    LAG (the one LAG rounds ago when every round drafts).
    `observe(...)`: a finished round's timings, for the online cost surface (cost.OnlineCost)."""

    def __init__(self, gamma: int, mode: str = "adaptive", cost=None, lag: int = LAG, explore: int = 32):
        if mode not in settings.DSPARK_VERIFY.choices:
            raise ValueError(
                f"{settings.DSPARK_VERIFY.name}={mode!r}: expected one of {', '.join(settings.DSPARK_VERIFY.choices)}"
            )
        self.gamma, self.mode, self.lag, self.explore = gamma, mode, lag, explore
        self.online, self._cost = None, None
        self.pad = None  # rows -> the rows a round runs at (the captured bucket), None: as planned
        self.calibration = Calibration(gamma)
        self._verified = None  # (raw conf, verify lengths) of the round planned, until learn()
        self.use(cost)
        self.round = 0
        self.skipped_in_a_row = 0
        self.history = {}  # slot -> {round: (gen, raw conf row)}
        self.last = {}  # diagnostics of the last plan: K, predicted tokens/s

    def use(self, cost, online: bool = True, agree=None) -> None:
        """Plan with `cost`: a cost.RoundCost (refined online from the rounds' timings unless
        `online` is False; `agree` makes every rank use the same refit), a cost.StepsTable or
        any callable t(R, rows) (used as given), or None."""
        self._cost = cost
        self.online = OnlineCost(cost, agree=agree) if online and isinstance(cost, RoundCost) else None
        self.calibration.agree = agree

    @property
    def cost(self):
        cost = self.online.cost if self.online is not None else self._cost
        return cost if cost is None or self.pad is None else Padded(cost, self.pad)

    def lagged(self, slots, gens) -> torch.Tensor:
        out = torch.ones(len(slots), self.gamma, dtype=torch.float64)
        for i, (slot, gen) in enumerate(zip(slots, gens)):
            recs = self.history.get(slot, {})
            old = [r for r in recs if r <= self.round - self.lag]
            rec = recs[max(old)] if old else None
            if rec is not None and rec[0] == gen and len(rec[1]) == self.gamma:
                out[i] = survival(self.calibration.apply(rec[1]))
        return out

    def decide(self, slots, gens) -> Decision:
        R, cost = len(slots), self.cost
        if self.mode == "static" or cost is None:
            return Decision(R * self.gamma)
        K, spec_tps = _best(self.lagged(slots, gens), cost)
        d = Decision(K, spec_tps=spec_tps)
        if getattr(cost, "draft", None) is not None and cost.draft(R) > 0:
            d.plain_tps = R / cost.plain(R)
            d.skip = d.plain_tps >= spec_tps and self.skipped_in_a_row + 1 < self.explore
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if d.skip else 0
        return d

    def plan(self, slots, gens, conf: torch.Tensor | None, decision: Decision | None = None) -> list[int]:
        R = len(slots)
        current = None if conf is None else survival(self.calibration.apply(conf))
        skip = decision is not None and decision.skip
        if skip:
            lens, K = [0] * R, 0
        elif self.mode == "static" or conf is None or self.cost is None:
            lens = [self.gamma] * R
            K = R * self.gamma
        else:
            K = (decision if decision is not None else self.decide(slots, gens)).budget
            lens = select(current, K)
            raw = conf.detach().to("cpu", torch.float64)
            self._verified = (raw, lens)
            for slot, gen, row in zip(slots, gens, raw):
                h = self.history.setdefault(slot, {})
                h[self.round] = (gen, row)
                # keep from the latest record the next round may read on (bounded: LAG + 1 at most)
                readable = [r for r in h if r <= self.round + 1 - self.lag]
                for old in [r for r in h if readable and r < max(readable)]:
                    del h[old]
        rows = R + sum(lens)
        self.last = dict(budget=K, rows=rows, skipped_draft=skip)
        if self.mode != "static":
            self.last["confidence_shift"] = [round(float(b), 3) for b in self.calibration.shift]
        cost = self.cost
        if cost is not None and self.mode != "static":
            self.last["predicted_seconds"] = cost.plain(R) if skip else cost(R, rows)
            if conf is not None or skip:
                self.last["expected_tokens"] = R + sum(float(current[i, :n].sum()) for i, n in enumerate(lens) if n)
        self.round += 1
        return lens

    def learn(self, accepted) -> None:
        """After the round's accept: accepted[r] drafts of request r were accepted (calibration)."""
        if self._verified is not None:
            conf, lens = self._verified
            self._verified = None
            self.calibration.learn(conf, lens, accepted)

    def observe(self, requests: int, rows: int, seconds: float, draft_seconds: float | None) -> None:
        if self.online is not None and requests:
            rows = rows if self.pad is None else self.pad(rows)
            self.online.observe(requests, rows, seconds, draft_seconds)


def batch_sizes(max_requests: int) -> list:
    """1, 2, 4, ... up to max_requests: the batch sizes a startup measurement times."""
    Rs = [1]
    while Rs[-1] * 2 <= max(1, max_requests):
        Rs.append(Rs[-1] * 2)
    return Rs


def best_of(fn) -> float:
    """Seconds of the faster of two calls of `fn` after an untimed warm-up."""
    best = None
    for rep in range(3):
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if rep:
            best = dt if best is None else min(best, dt)
    return best


@torch.no_grad()
def measure_cost(
    trunk,
    cache,
    gamma: int,
    max_requests: int = 16,
    budget_s: float = 3.0,
    start: int = 64,
    agree=None,
    drafter=None,
    graphs=None,
    ks=None,
):
    """The seed of the round cost surface (cost.py) on this machine: timed verify stages (the
    target forward keeping the draft's target layers, then the head) over R requests of k rows
    (R in 1, 2, 4, ... <= max_requests; k in 1, gamma // 2 + 1, gamma + 1), writes deferred and
    dropped (the cache is not touched), and with a `drafter` its draft step
    over the same R requests; one untimed warm-up each, best of two. The four corners (fewest and
    most requests, fewest and most rows) come first and always; the points between follow until
    `budget_s` is spent, so a loaded machine interpolates between measured extremes instead of
    extrapolating from small batches. Slot 0 is read for every request: its contents do not
    change the cost. The round's other stages are learned online (cost.OnlineCost).
    `agree(flag) -> bool`: under TP the forwards hold collectives, so every rank must stop after
    the same point: the stop is true everywhere once it is true on one rank (RankSync.any).
    `graphs` (graphs.VerifyGraphs): the verify as the rounds run it, captured where a bucket holds
    the rows; a point is then recorded at the bucket's rows (`graphs.rows_for`), as the planner
    prices and the online learner records it (cost.Padded). `ks`: the rows per request to time
    instead (each then measured at the fewest and the most requests whatever the budget: the
    rows a NextN round verifies in each of its shapes, shapes.py)."""
    start = max(0, min(start, cache.max_context_len - gamma - 2))
    Rs = batch_sizes(max_requests)
    given = ks
    ks = sorted({1, gamma // 2 + 1, gamma + 1} if ks is None else set(ks))
    points, t_begin = [], time.perf_counter()
    dev = cache.device if cache.device is not None else "cpu"

    # given rows per request (`ks`: the shapes a NextN round may take) are each a corner
    extremes = (ks[0], ks[-1]) if given is None else ks
    corners = list(dict.fromkeys((R, k) for R in (Rs[0], Rs[-1]) for k in extremes))
    order = corners + [(R, k) for R in Rs for k in ks if (R, k) not in corners]
    # what a round's verify stage runs (engine.py): the forward keeping the draft's target layers,
    # then the head over its rows (on the tiny model that closed none of the gap between
    # predicted and measured rounds measurably; on DeepSeek-V4 the 129K-row head is not small)
    layer_ids = tuple(getattr(drafter, "layer_ids", ()) or (graphs.layer_ids if graphs is not None else ()))
    head = getattr(trunk, "compute_logits", None)

    def verify(segs, ids, pos):
        aux = {"layer_ids": layer_ids}
        h = None if graphs is None else graphs.run(segs, ids, pos, [], dict(aux))
        if h is None:
            h = trunk(ids, pos, segs, cache, pending=[], aux=aux)
        return h if head is None else head(h)

    draft_of = {}  # R -> seconds of its draft step (0 without a drafter), in measuring order
    plain = []  # (R, seconds) of the one-row forwards alone: a plain decode step (guard.py reads them)
    for i, (R, k) in enumerate(order):
        if R not in draft_of:
            draft_of[R] = 0.0 if drafter is None else best_of(lambda: drafter.draft([0] * R, [start] * R, [0] * R))
        segs = [Segment(0, start, k)] * R
        ids = torch.zeros(R * k, dtype=torch.long, device=dev)
        pos = torch.arange(start, start + k, device=dev).repeat(R)
        t = best_of(lambda: verify(segs, ids, pos))
        points.append((R, R * k if graphs is None else graphs.rows_for(R * k), t + draft_of[R]))
        if k == 1:
            plain.append((R, t))
        if i + 1 >= len(corners):
            spent = time.perf_counter() - t_begin > budget_s
            if agree(spent) if agree is not None else spent:
                break
    drafts = list(draft_of.items()) if drafter is not None else []
    source = f"measured at startup, {len(points)} points"
    cost = from_points(points, max_requests, max_requests * (gamma + 1), drafts or None, source=source)
    cost.points, cost.draft_points = [list(p) for p in points], [list(d) for d in drafts]
    cost.plain_points = plain
    return cost
