"""Server-side speculative counters: per-stage wall time (engine.STAGES), rounds, drafted,
verified and committed tokens, accepted drafts by position (draft k was tested in a request-round
when drafts 1..k-1 were accepted and the node accepted last had a child), rounds that skipped drafting, the
planner's confidence calibration (logit offset per draft position), NextN's rounds by shape
(shapes.py), and per batch size the
planner's predicted round time next to the measured one (so a user sees why it chose what it
chose, and how far its cost surface is off). Aggregated over the worker's life;
SGLang prints `log_suffix()` in its decode log line and returns `snapshot()` in /get_server_info
(internal_states[*].dspark_info_record), the same place its own DSpark worker reports to."""

from __future__ import annotations

from .engine import STAGES


class StageStats:
    def __init__(self):
        self.rounds = 0  # batch rounds
        self.request_rounds = 0
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self.drafted = self.verified = self.committed = 0
        # [k-1]: request-rounds that tested draft k (verified it, and accepted drafts 1..k-1), and
        # those that accepted it: their ratio is the conditional acceptance at position k
        self.verified_at = []
        self.accepted_at = []
        self.skipped_draft = 0
        self.confidence_shift = None  # the planner's latest calibration offsets per draft position
        self.by_batch = {}  # R -> [rounds, predicted seconds, measured seconds] (rounds with a prediction)
        self.by_shape = {}  # NextN round shape (shapes.py) -> rounds
        self.by_guard = {}  # the guard's reason (guard.py: learning, relearning, exploring, ...) -> rounds

    def add(self, res) -> None:
        self.rounds += 1
        for k, v in res.timings.items():
            self.seconds[k] = self.seconds.get(k, 0.0) + v
        self.skipped_draft += bool(res.plan.get("skipped_draft"))
        self.confidence_shift = res.plan.get("confidence_shift", self.confidence_shift)
        if "guard" in res.plan:
            self.by_guard[res.plan["guard"]] = self.by_guard.get(res.plan["guard"], 0) + 1
        if "shape" in res.plan:
            self.by_shape[res.plan["shape"]] = self.by_shape.get(res.plan["shape"], 0) + 1
        if res.plan.get("predicted_seconds") is not None:
            row = self.by_batch.setdefault(len(res.trees), [0, 0.0, 0.0])
            row[0] += 1
            row[1] += res.plan["predicted_seconds"]
            row[2] += sum(res.timings.values())
        for tree, path, drafted in zip(res.trees, res.paths, res.drafted):
            self.request_rounds += 1
            self.drafted += drafted
            self.verified += tree.n - 1
            self.committed += len(path)
            # draft k was tested when drafts 1..k-1 were accepted and the node accepted last had a
            # child: in a tree that node may be a leaf while another branch reaches deeper
            tested = len(path) - (not tree.children(path[-1]))
            if len(self.verified_at) < tested:
                self.verified_at += [0] * (tested - len(self.verified_at))
                self.accepted_at += [0] * (tested - len(self.accepted_at))
            for k in range(tested):
                self.verified_at[k] += 1
            for k in range(len(path) - 1):
                self.accepted_at[k] += 1

    def snapshot(self) -> dict:
        n = max(1, self.rounds)
        rr = max(1, self.request_rounds)
        return {
            "rounds": self.rounds,
            "request_rounds": self.request_rounds,
            "stage_ms_per_round": {k: round(v * 1e3 / n, 3) for k, v in self.seconds.items()},
            "stage_seconds_total": {k: round(v, 4) for k, v in self.seconds.items()},
            "drafted_tokens": self.drafted,
            "verified_draft_tokens": self.verified,
            "committed_tokens": self.committed,
            "verified_per_request_round": round(self.verified / rr, 4),
            "accept_length": round(self.committed / rr, 4),
            # request-rounds that drafted (draft 1 is tested in every one; a plain step drafts
            # nothing) and the drafts they accepted: their ratio is the acceptance that plain
            # steps do not dilute
            "drafting_request_rounds": self.verified_at[0] if self.verified_at else 0,
            "accepted_drafts": sum(self.accepted_at),
            "acceptance_by_position": [
                round(a / v, 4) if v else None for a, v in zip(self.accepted_at, self.verified_at)
            ],
            "skipped_draft_rounds": self.skipped_draft,
            "confidence_shift": self.confidence_shift,
            "rounds_by_shape": dict(self.by_shape),
            "rounds_by_guard": dict(self.by_guard),
            "round_ms_by_batch": {
                R: {"rounds": n, "predicted_ms": round(p * 1e3 / n, 3), "measured_ms": round(m * 1e3 / n, 3)}
                for R, (n, p, m) in sorted(self.by_batch.items())
            },
        }

    def log_suffix(self) -> str:
        if not self.rounds:
            return ""
        s = self.snapshot()
        ms = " ".join(f"{k} {v:.1f}" for k, v in s["stage_ms_per_round"].items())
        out = f"stage ms/round: {ms}; verified/req-round {s['verified_per_request_round']:.2f}"
        if self.by_batch:
            n, p, m = (sum(v[i] for v in self.by_batch.values()) for i in range(3))
            out += f"; skipped drafting {self.skipped_draft}/{self.rounds} rounds; predicted/measured {p / m:.2f}"
        if self.by_guard:
            out += "; guard " + ", ".join(f"{k} {v}" for k, v in sorted(self.by_guard.items()))
        if self.by_shape:
            out += "; shapes " + " ".join(f"{k} {v}" for k, v in sorted(self.by_shape.items()))
        return out
