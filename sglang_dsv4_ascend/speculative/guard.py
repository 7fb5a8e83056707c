"""Never slower than no speculation, by measurement (issue #33): whether a round drafts at all.

The planners (planner.py for DSpark, shapes.py for NextN) decide from a cost surface, and a surface
can be off: the DSpark planner's was measured 30 % low at 16 requests, where it kept drafting at
0.79x of plain decoding (in process, this CPU). The guard decides from what the rounds themselves
measured instead. For each batch-size class (R in 1, 2, 3, 4, 5-6, 7-8, 9-12, 13-16, ...: steps
of about sqrt 2, so that the rounds compared are of about the same batch) it keeps the last `keep`
per-request rates

    rate = tokens emitted / (R * seconds of the round)

of rounds that drafted and of rounds that did not (a plain decode step: each request verifies its
anchor row and the draft's state is extended as after any round, engine.SpecEngine.round). A
class drafts for its first `first` rounds. If their median rate beats a plain step's by more than
`sure` (a margin no noise of this size explains: at one request on this CPU drafting is 2x) it
keeps drafting; a plain step's rate is then 1 / t_plain(R), `plain` timed at startup
(planner.measure_cost over one row a request: the verify stage alone, target forward and head,
so it reads fast and errs toward trying plain steps; and t_plain(R) is the fastest timing at R or more requests,
since a timing taken while the machine was busy once read 40 ms at one request and 17 ms at
two, and made drafting that accepted nothing look a sure win). Otherwise it runs `first` plain
rounds and from then on takes whichever of the two measured medians is higher (ties: draft).
The loser is taken again now and then so that its figure stays current (acceptance moves with
the prompts, the cost with the contexts), except a plain step when drafting wins by more than
`sure` against measured plain steps; a win against the startup timing alone is checked by a plain
step every `explore`-th round until `first` are measured. Medians make one descheduled round
irrelevant.

How often the loser is taken: an exploring round costs what the loser loses, 1 - min(ratio,
1 / ratio) of a round, so the loser is taken every `explore_cost` / that many rounds, between
`explore_min` and `explore` (with 1 %: a loser at 0.9 every 10th round, one at 0.67 or worse every
32nd). A narrow loser is the one most likely to have become the winner, and it is the cheapest to
check.

How fast a change of regime is followed: the medians of the last `keep` rounds move only once
half of them are new, and the loser gets one new round an interval: 8 intervals, 256 rounds at
32. That was too slow where acceptance changes with the request. Served at one request with
graphs, the first prompt's drafts were accepted 1.1 tokens a round, plain won narrowly, and the
guard ran 229 plain rounds while the next prompts' drafts would have been accepted 3 a round. So
when more than half of the loser's last `first` explored rounds beat the winner's median (3 of 4:
their lower median does), the regime has changed: the loser's figure becomes those rounds alone,
and the refit takes the new winner (4 explorations: 40 rounds at 0.9). Not all of them: a drafting
round's rate varies with what it accepted, and a round that accepts nothing loses to a plain step
whatever the prompt.

A batch of at most `turnover_max` requests is its requests: when most of a class's batch has
joined since the class last drafted, and plain is winning, the next `first` rounds draft (the new
requests' own figure) and the class is refitted after them. At one request that is every new
request: its first 4 rounds tell whether its drafts pay, instead of the previous prompts'. A
larger batch's acceptance is the mean of many requests' and moves little when half of them change.

Lossless: whether a round drafts is fixed from finished rounds' timings before it drafts, and a
plain round is an ordinary round with no drafts (its bonus token is the target's own sample), so
the choice depends on nothing the round draws.

Ranks: the choice counters depend only on the rounds taken, the same on every rank; the timings
differ per rank, so the winner of each class is refitted from one rank's medians (`agree`,
spec_sync.RankSync.broadcast) every `every` rounds and whenever a class has just got its `first`
rounds of either kind (the plain step's startup timing is rank 0's too, speculative/worker.py).
The exploring interval is read from the agreed ratio. A change of regime is found from each
rank's own timings and may shorten one rank's figure and not another's; it never leaves fewer than
`first` rounds, so the round counts that trigger a refit stay alike on every rank.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque

from .cost import interp
from .planner import batch_sizes, measure_cost

_BOUNDS = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024]


def batch_class(R: int) -> int:
    """The class of a batch of R requests: the smallest bound >= R (bounds about sqrt 2 apart)."""
    i = bisect.bisect_left(_BOUNDS, R)
    return _BOUNDS[i] if i < len(_BOUNDS) else _BOUNDS[-1] * (1 + (R - 1) // _BOUNDS[-1])


class Guard:
    def __init__(
        self,
        first: int = 4,
        keep: int = 16,
        explore: int = 32,
        sure: float = 1.25,
        every: int = 8,
        agree=None,
        plain=None,
        explore_min: int = 4,
        explore_cost: float = 0.01,
        turnover_max: int = 4,
    ):
        """`plain`: [(R, seconds of a plain round of R requests)] timed at startup, or None."""
        self.first, self.keep, self.explore, self.sure = first, keep, explore, sure
        self.explore_min, self.explore_cost, self.turnover_max = explore_min, explore_cost, turnover_max
        self.covered = {}  # class -> the requests of its last drafting round
        self.relearn = {}  # class -> drafting rounds still to take for the requests that joined
        self.refit_due = False
        self.every, self.agree = every, agree
        self.plain = None
        if plain:  # the fastest timing at R or more requests: a busy moment reads slow, never fast
            pts = sorted(plain)
            self.plain = [(R, min(t for _, t in pts[i:])) for i, (R, _) in enumerate(pts)]
        self.rates = {}  # class -> {True: deque of drafting rounds' (R, rate), False: plain rounds'}
        self.explored = {}  # class -> (the kind explored, deque of its last `first` explored rates)
        self.turn = {}  # class -> rounds of the class chosen so far
        # class -> (draft wins, drafting median / plain median, plain measured), agreed at refits
        self.winner = {}
        self.rounds = 0
        self.last = {}

    def _rates(self, c: int) -> dict:
        return self.rates.setdefault(c, {True: deque(maxlen=self.keep), False: deque(maxlen=self.keep)})

    def draft(self, R: int, keys=None) -> bool:
        """Whether a round of R requests drafts; `keys`: the requests (ids the same on every rank),
        or None."""
        c = batch_class(R)
        k = self.turn.get(c, 0)
        self.turn[c] = k + 1
        seen = self._rates(c)
        wins = self.winner.get(c, (None,))[0]
        if keys is not None and wins is False and R <= self.turnover_max and c not in self.relearn:
            joined = set(keys) - self.covered.get(c, set())
            if 2 * len(joined) > len(keys):  # mostly new requests: their own drafting figure
                self.relearn[c] = self.first
                self.explored[c] = (True, deque(maxlen=self.first))
        if len(seen[True]) < self.first:
            why, out = "learning drafting", True
        elif c not in self.winner:  # refitted when the class got `first` drafting rounds
            why, out = "learning plain", False
        elif c in self.relearn:
            why, out = "relearning drafting", True  # for the requests that joined
            self.relearn[c] -= 1
            if not self.relearn[c]:
                del self.relearn[c]
                self.refit_due = True  # after this round: the same round on every rank
        else:
            wins, ratio, measured = self.winner[c]
            explore = k % self.interval(ratio, measured) == 0 and (not wins or ratio < self.sure or not measured)
            out = wins != explore
            why = ("exploring " if explore else "") + ("drafting" if out else "plain")
        if out and keys is not None and R <= self.turnover_max:
            self.covered[c] = set(keys)
        self.last = {"guard": why, "guard_class": c}
        return out

    def learn(self, R: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A finished round of R requests: whether it drafted, the tokens it emitted, its seconds."""
        if not R or seconds <= 0:
            return
        c = batch_class(R)
        seen = self._rates(c)
        rate = tokens / (R * seconds)
        seen[drafted].append((R, rate))
        if c in self.winner and drafted != self.winner[c][0]:  # the loser, explored
            if self.explored.get(c, (None,))[0] != drafted:
                self.explored[c] = (drafted, deque(maxlen=self.first))
            self.explored[c][1].append((R, rate))
        self.rounds += 1
        # a class that just got its `first` rounds of either kind is decided now (the counts are
        # the same on every rank, so every rank refits here)
        if self.rounds % self.every == 0 or len(seen[drafted]) == self.first or self.refit_due:
            self.refit_due = False
            self.refit()

    def ratio(self, c: int) -> float | None:
        """Drafting's median rate over a plain step's in class c: measured plain rounds once there
        are `first`, else the startup timing; None while neither is known."""
        seen = self.rates.get(c)
        if seen is None or len(seen[True]) < self.first:
            return None
        if len(seen[False]) >= self.first:
            return statistics.median(r for _, r in seen[True]) / max(
                1e-12, statistics.median(r for _, r in seen[False])
            )
        if self.plain is None:
            return None
        xs, ts = [R for R, _ in self.plain], [t for _, t in self.plain]
        return statistics.median(r * interp(xs, ts, R) for R, r in seen[True])

    def interval(self, ratio: float, measured: bool = True) -> int:
        """Rounds of a class between two explorations of its loser: fewer the less it loses."""
        if not measured:
            return self.explore
        cost = 1.0 - min(ratio, 1.0 / max(ratio, 1e-12))
        return int(min(self.explore, max(self.explore_min, round(cost / self.explore_cost))))

    def _regime_change(self, c: int) -> None:
        """More than half of the loser's last `first` explored rounds beat the winner's median: its
        figure becomes those rounds (they describe the present; the older ones another prompt, say)."""
        wins, _, measured = self.winner.get(c, (None, None, False))
        kind, rates = self.explored.get(c, (None, ()))
        if not measured or kind is None or kind == wins or len(rates) < self.first:
            return
        seen = self.rates[c]
        if statistics.median_low(r for _, r in rates) > statistics.median(r for _, r in seen[wins]):
            seen[kind].clear()
            seen[kind].extend(rates)
            del self.explored[c]

    def refit(self) -> None:
        for c in list(self.explored):
            self._regime_change(c)
        table = {}
        for c, seen in self.rates.items():
            ratio = self.ratio(c)
            # against the startup timing alone, only a sure win counts: else plain steps are measured
            measured = len(seen[False]) >= self.first
            if ratio is not None and (measured or ratio >= self.sure):
                table[c] = (ratio >= 1.0, ratio, measured)
        self.winner = table if self.agree is None else self.agree(table)
        for c in list(self.explored):  # explored rounds count against the winner they lost to
            if self.explored[c][0] == self.winner.get(c, (None,))[0]:
                del self.explored[c]

    def describe(self) -> dict:
        """Per class: rounds each way, the medians' ratio (drafting / plain) and the winner."""
        out = {}
        for c, seen in sorted(self.rates.items()):
            row = {"drafting_rounds": len(seen[True]), "plain_rounds": len(seen[False])}
            if c in self.winner:
                wins, ratio, measured = self.winner[c]
                row.update(drafting_over_plain=round(ratio, 3), choice="drafting" if wins else "plain")
                row["against"] = "plain rounds" if measured else "the startup timing"
            out[f"R<={c}"] = row
        return out


def plain_round_seconds(trunk, cache, max_requests: int, agree=None, graphs=None, seed=None) -> tuple:
    """([(R, seconds)], where they came from) of the verify stage (target forward and head) over
    R one-row requests, R in 1, 2, 4, ... <= max_requests (planner.measure_cost: best of two, the
    cache untouched; `agree`, `graphs` as there): the startup estimate of a plain step's cost. A
    cost seed the worker measured at startup anyway (DSpark adaptive's surface, NextN's shapes)
    already holds these forwards (`plain_points`: one row a request, the draft's time apart):
    when it timed every batch size, they are read from it and nothing is timed twice. Otherwise
    (no seed, or its time budget ran out before the batch sizes between the extremes) they are
    timed here."""
    points = getattr(seed, "plain_points", None) or []
    source = "read from the startup cost seed"
    if not set(batch_sizes(max_requests)) <= {R for R, _ in points}:
        seed = measure_cost(trunk, cache, 0, max_requests=max_requests, agree=agree, graphs=graphs, ks=[1])
        points, source = seed.plain_points, "timed"
    return [(int(R), float(t)) for R, t in points], source
