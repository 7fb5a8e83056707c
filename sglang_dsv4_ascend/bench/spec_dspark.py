"""`bench spec --algo dspark`: DSpark static vs adaptive verify vs NextN vs no speculation on the tiny
DeepSeek-V4, in process, one run, every ratio measured side by side.

    python -m sglang_dsv4_ascend.bench spec --algo dspark [--verify static,adaptive] [--batch 1,8,16]
        [--gamma 4] [--drafters dspark,replay] [--new-tokens 32] [--prompt-len 64]

Two checkpoints share one trunk, one with the DSpark draft and one with a NextN block (random:
written from the same seed, the generator draws the trunk first; trained: the shipped pair), which
the run checks (`same_trunk`: every trunk tensor equal). NextN runs as a chain of gamma steps
(the same verify width as a DSpark block). The adaptive planner's round cost surface is seeded
once on this machine before the runs (planner.measure_cost, reported) and refined online in each
run (speculative/cost.py), as the server does. Drafters: "dspark" is the checkpoint's draft
(`--model trained`: the shipped trained one, with its calibration file; `random`: acceptance near
zero);
"replay" is the test drafter in "full" mode fed the no-spec outputs, with its synthetic
confidences (0.9 on the right tokens), so acceptance is maximal and the planner has something to
trust: it bounds what the machinery costs; "replay-zero" the same drafter with every first draft
wrong: no draft is ever accepted (a draft that does not know the traffic), the case where
speculation can only cost.

`--guard on,off`: each configuration with the speculation guard (speculative/guard.py, as served)
and without it (`dspark_<mode>_unguarded`), side by side.

Per configuration: mean accept length (bonus included), committed tokens per target row,
target rows per batch round ("target tokens per step"), drafted / verified drafts per
request-round, stage ms per round, decode tok/s and its ratios to no-spec and to NextN; for
adaptive, the planner's prediction next to the measurement: predicted tokens/s = sum of expected
tokens / sum of predicted round seconds over the rounds, measured = committed tokens / round
seconds; the mean predicted and measured round ms and the rounds that skipped drafting. Greedy,
EOS ignored; timings are one run on this machine, never asserted.
"""

from __future__ import annotations

import time
import types

import torch

from .. import settings
from .spec_common import InProcess, drafter_factory, guard, log, mean, prompt_ids, replay_file, rounded

VERIFY = ("static", "adaptive")
DRAFTERS = ("dspark", "replay", "replay-zero")


class DSparkInProcess:
    def __init__(self, ckpt: str, trunk):
        from ..models.dspark import load_dspark_from_dir

        self.trunk = trunk
        self.draft = load_dspark_from_dir(ckpt, trunk.cfg)
        self.model = types.SimpleNamespace(model=trunk, dspark=self.draft, cfg=trunk.cfg)
        self.guard = settings.SPEC_GUARD.get()  # the speculation guard in every spec run, as served

    def engine(self, cache, gamma: int, drafter_factory, planner=None):
        from ..speculative.engine import SpecEngine

        return SpecEngine(
            self.model,
            cache,
            drafter_factory,
            torch.Generator().manual_seed(0),
            planner=planner,
            gamma=gamma,
            topk=1,
            num_steps=gamma,
            num_draft_tokens=gamma + 1,
        )

    def seed_cost(self, gamma: int, max_requests: int, max_len: int, budget_s: float = 10.0):
        """The adaptive planner's startup seed as the worker measures it (speculative/worker.py):
        the verify stage and the checkpoint's draft step, on a cache of its own."""
        from ..speculative.drafters import DSparkDrafter
        from ..speculative.planner import measure_cost

        cache = self.trunk.make_cache(1, max_len, gamma + 1)
        drafter = self.engine(cache, gamma, DSparkDrafter).drafter
        return measure_cost(self.trunk, cache, gamma, max_requests=max_requests, budget_s=budget_s, drafter=drafter)

    @torch.no_grad()
    def spec(self, prompts, gamma: int, mode: str, cost, drafter_factory, new_tokens: int, max_len: int) -> dict:
        from ..batch import Segment
        from ..speculative.engine import STAGES
        from ..speculative.planner import Planner

        B = len(prompts)
        cache = self.trunk.make_cache(B, max_len, gamma + 1)
        planner = Planner(gamma, mode, cost)
        eng = self.engine(cache, gamma, drafter_factory, planner)
        eng.guard = guard(self.guard, self.trunk, cache, B)
        segs = [Segment(b, 0, len(p)) for b, p in enumerate(prompts)]
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        aux = {"layer_ids": getattr(eng.drafter, "layer_ids", ())}
        h = self.trunk(ids, pos, segs, cache, aux=aux)
        last = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1
        first = self.trunk.compute_logits(h[last]).argmax(-1).tolist()
        shifted = [t for p, f in zip(prompts, first) for t in p[1:] + [f]]
        eng.extend(segs, torch.tensor(shifted), aux, None, list(enumerate(last.tolist())))
        outs = [[t] for t in first]
        lens = [len(p) for p in prompts]
        acc = dict(accept=[], rows=[], drafted=[], verified=[], batch_rows=[], expected=0.0, predicted_s=0.0, skipped=0)
        timings = dict.fromkeys(STAGES, 0.0)
        rounds = 0
        active = [b for b in range(B) if len(outs[b]) < new_tokens]
        t0 = time.perf_counter()
        while active:
            r = eng.round(
                active,
                [lens[b] for b in active],
                [outs[b][-1] for b in active],
                None,
                [prompts[b] + outs[b] for b in active],
                gens=active,
            )
            rounds += 1
            for k in timings:
                timings[k] += r.timings[k]
            acc["batch_rows"].append(sum(t.n for t in r.trees))
            acc["expected"] += r.plan.get("expected_tokens", 0.0)
            acc["predicted_s"] += r.plan.get("predicted_seconds", 0.0)
            acc["skipped"] += bool(r.plan.get("skipped_draft"))
            for b, em, n, tree, d in zip(active, r.emitted, r.accept_lens, r.trees, r.drafted):
                outs[b] += em
                lens[b] += n
                acc["accept"].append(n)
                acc["rows"].append(tree.n)
                acc["drafted"].append(d)
                acc["verified"].append(tree.n - 1)
            active = [b for b in active if len(outs[b]) < new_tokens]
        by_batch = eng.guard.describe() if eng.guard is not None else None
        dt = time.perf_counter() - t0
        return {"outputs": outs, "decode_s": dt, "rounds": rounds, "timings": timings, "guard": by_batch, **acc}


def run(
    ckpts: dict,
    workdir: str,
    batches,
    verify,
    drafters,
    gamma: int | None,
    new_tokens: int,
    prompt_len: int,
    guards=(True,),
) -> dict:
    """`ckpts`: {"nextn": dir, "dspark": dir}, one trunk with either draft (checked: same_trunk)."""
    from ..models.dspark import load_sts, sts_path
    from ..models.weights import load_model_from_dir
    from ..speculative.cost import describe
    from ..speculative.drafters import DSparkDrafter, ReplayDrafter

    ds_ckpt, nx_ckpt = ckpts["dspark"], ckpts["nextn"]
    nx = InProcess(nx_ckpt)
    ds = DSparkInProcess(ds_ckpt, load_model_from_dir(ds_ckpt))
    nx.guard = ds.guard = guards[0]
    ds.draft.sts = load_sts(sts_path(None, ds_ckpt))  # the checkpoint's own calibration, as the server loads it
    a, b = nx.trunk.state_dict(), ds.trunk.state_dict()
    same_trunk = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    gamma = gamma or ds.trunk.cfg.dspark_block_size
    max_len = prompt_len + new_tokens + gamma + 2
    prompts_all = prompt_ids(ds_ckpt, max(batches), prompt_len)
    cost = ds.seed_cost(gamma, max(batches), max_len)
    log(f"round cost seed (verify stage and draft step; the rest is learned online): {describe(cost)} ({cost.source})")
    for B in batches:  # warm-up, untimed (TorchScript profiles its first runs)
        ds.spec(prompts_all[:B], gamma, "static", None, DSparkDrafter, 3, max_len)
        nx.spec(prompts_all[:B], (1, gamma, gamma + 1), drafter_factory("nextn", None), 3, max_len)
    log("warm-up done")
    results = []
    for B in batches:
        prompts = prompts_all[:B]
        base = nx.nospec(prompts, new_tokens, new_tokens + gamma, max_len)
        refs = base["outputs"]
        tok = B * base["steps"]
        base_tps = tok / base["decode_s"]
        results.append({"config": "nospec", "batch": B, "tok_s": rounded(base_tps, 1), "tok_s_ratio_to_nospec": 1.0})
        n = nx.spec(prompts, (1, gamma, gamma + 1), drafter_factory("nextn", None), new_tokens, max_len)
        nx_tps = tok / n["decode_s"]
        results.append(
            {
                "config": f"nextn_chain{gamma}",
                "drafter": "nextn",
                "batch": B,
                "mean_accept_length": rounded(mean(n["accept"]), 4),
                "tok_s": rounded(nx_tps, 1),
                "tok_s_ratio_to_nospec": rounded(nx_tps / base_tps, 3),
                "lossless": all(o == ref[: len(o)] for o, ref in zip(n["outputs"], refs)),
            }
        )
        replay = {m: replay_file(workdir, prompts, refs, f"ds-b{B}", m) for m in ("full", "zero")}
        for mode, dr, on in [(m, d, g) for m in verify for d in drafters for g in guards]:
            path = replay["zero" if dr == "replay-zero" else "full"]
            factory = DSparkDrafter if dr == "dspark" else (lambda e, p=path: ReplayDrafter(e, p))
            ds.guard = on
            s = ds.spec(prompts, gamma, mode, cost if mode == "adaptive" else None, factory, new_tokens, max_len)
            tps = tok / s["decode_s"]
            rr = s["rounds"]
            row = {
                "config": f"dspark_{mode}" + ("" if on else "_unguarded"),
                "drafter": dr,
                "batch": B,
                "gamma": gamma,
                "rounds": rr,
                "mean_accept_length": rounded(mean(s["accept"]), 4),
                "committed_per_target_row": rounded(sum(s["accept"]) / max(1, sum(s["rows"])), 4),
                "target_rows_per_round": rounded(mean(s["batch_rows"]), 3),
                "drafted_per_request_round": rounded(mean(s["drafted"]), 3),
                "verified_drafts_per_request_round": rounded(mean(s["verified"]), 3),
                **{f"{k}_ms_per_round": rounded(v * 1e3 / rr, 3) for k, v in s["timings"].items()},
                "tok_s": rounded(tps, 1),
                "tok_s_ratio_to_nospec": rounded(tps / base_tps, 3),
                "tok_s_ratio_to_nextn": rounded(tps / nx_tps, 3),
                "lossless": all(o == ref[: len(o)] for o, ref in zip(s["outputs"], refs)),
            }
            if mode == "adaptive" and s["predicted_s"] > 0:
                round_s = sum(s["timings"].values())
                row["planner_predicted_tok_s"] = rounded(s["expected"] / s["predicted_s"], 1)
                row["measured_round_tok_s"] = rounded(sum(s["accept"]) / round_s, 1)
                row["planner_predicted_round_ms"] = rounded(s["predicted_s"] * 1e3 / rr, 3)
                row["measured_round_ms"] = rounded(round_s * 1e3 / rr, 3)
            if s["guard"] is not None:
                row["guard_by_batch"] = s["guard"]
            if (mode == "adaptive" and s["predicted_s"] > 0) or s["guard"] is not None:
                row["skipped_draft_rounds"] = s["skipped"]
            results.append(row)
            log(
                f"batch {B} {row['config']} {dr}: accept {row['mean_accept_length']}, rows/round "
                f"{row['target_rows_per_round']}, {row['tok_s']} tok/s (x{row['tok_s_ratio_to_nospec']} "
                f"nospec, x{row['tok_s_ratio_to_nextn']} nextn), lossless {row['lossless']}"
            )
    return {"gamma": gamma, "same_trunk": same_trunk, "cost_model": cost.to_json(), "results": results}
