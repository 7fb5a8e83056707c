"""What both speculative benchmarks (`bench spec --algo nextn`: spec.py; `--algo dspark`:
spec_dspark.py) run in process: the packaged prompts cut to one length, the trunk with its NextN
block and the engine's rounds (`InProcess`), the replay drafter's reference file, and the
rounding of the JSON figures.
"""

from __future__ import annotations

import json
import os
import sys
import time
import types

import torch

from .. import settings
from ..batch import Segment


def log(msg: str) -> None:
    print(f"[bench spec] {msg}", file=sys.stderr, flush=True)


def prompt_ids(ckpt: str, n: int, prompt_len: int) -> list:
    """`n` prompts of exactly `prompt_len` tokens from the packaged sets, round-robin."""
    from transformers import AutoTokenizer

    from ..data import PROMPT_SETS, load_prompts

    tok = AutoTokenizer.from_pretrained(ckpt)
    sets = [load_prompts(name, max_chars=None) for name in PROMPT_SETS]
    out = []
    for i in range(max(len(s) for s in sets)):
        for s in sets:
            if i < len(s):
                ids = tok(s[i])["input_ids"]
                if len(ids) >= prompt_len:
                    out.append(list(ids[:prompt_len]))
                    if len(out) == n:
                        return out
    raise ValueError(f"--prompt-len {prompt_len}: only {len(out)} packaged prompts are that long, {n} needed")


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def rounded(x, nd=3):
    return None if x is None else round(x, nd)


def guard(on: bool, trunk, cache, max_requests: int):
    """The worker's speculation guard (speculative/guard.py) when `on`, with the plain step timed
    as the worker times it at startup (untimed here)."""
    from ..speculative.guard import Guard, plain_round_seconds

    return Guard(plain=plain_round_seconds(trunk, cache, min(max_requests, 16))[0]) if on else None


class InProcess:
    """The model, its NextN block and the engine on this process's CPU. `trunk`: a target already
    built from `ckpt` (e.g. with another `index_topk_freq`: bench/indexcache.py); default: loaded."""

    def __init__(self, ckpt: str, trunk=None):
        from ..models.nextn import load_nextn_from_dir
        from ..models.weights import load_model_from_dir

        self.trunk = load_model_from_dir(ckpt) if trunk is None else trunk
        self.nextn = load_nextn_from_dir(ckpt, self.trunk.cfg)
        self.model = types.SimpleNamespace(model=self.trunk, nextn=self.nextn, cfg=self.trunk.cfg)
        self.guard = settings.SPEC_GUARD.get()  # the speculation guard in every spec run, as served

    @torch.no_grad()
    def _prefill(self, cache, prompts):
        segs, off, last = [], 0, []
        for b, p in enumerate(prompts):
            segs.append(Segment(b, 0, len(p)))
            off += len(p)
            last.append(off - 1)
        ids = torch.tensor([t for p in prompts for t in p])
        pos = torch.cat([torch.arange(len(p)) for p in prompts])
        aux = {}
        h = self.trunk(ids, pos, segs, cache, aux=aux)
        first = self.trunk.compute_logits(h[torch.tensor(last)]).argmax(-1).tolist()
        return segs, last, first, aux

    @torch.no_grad()
    def nospec(self, prompts, new_tokens: int, total: int, max_len: int) -> dict:
        """Greedy decode of `total` tokens per request; timed over the first `new_tokens`."""
        B = len(prompts)
        cache = self.trunk.make_cache(B, max_len)
        _, _, first, _ = self._prefill(cache, prompts)
        outs = [[t] for t in first]
        lens = [len(p) for p in prompts]
        decode_s = 0.0
        t0 = time.perf_counter()
        for step in range(1, total):
            ids = torch.tensor([o[-1] for o in outs])
            pos = torch.tensor(lens)
            h = self.trunk(ids, pos, [Segment(b, lens[b], 1) for b in range(B)], cache)
            nxt = self.trunk.compute_logits(h).argmax(-1).tolist()
            for b in range(B):
                outs[b].append(nxt[b])
                lens[b] += 1
            if step == new_tokens - 1:
                decode_s = time.perf_counter() - t0
        return {"outputs": outs, "decode_s": decode_s, "steps": new_tokens - 1}

    @torch.no_grad()
    def spec(
        self, prompts, shape, drafter_factory, new_tokens: int, max_len: int, node_once: bool = True, shapes=False
    ) -> dict:
        """`shapes`: each round's shape (tree, chain, no draft) chosen by speculative/shapes.py,
        seeded as the server's worker seeds it (untimed)."""
        from ..speculative.engine import NextNEngine

        topk, steps, ndraft = shape
        B = len(prompts)
        cache = self.trunk.make_cache(B, max_len, ndraft)
        eng = NextNEngine(self.model, cache, topk, steps, ndraft, drafter_factory, torch.Generator().manual_seed(0))
        eng.node_once = node_once  # trees: each node once, or each root-to-leaf path (engine.verify_segments)
        eng.guard = guard(self.guard, self.trunk, cache, B)
        if shapes:
            from ..speculative.shapes import ShapePlanner, measure

            planner = ShapePlanner(topk, steps, ndraft)
            planner.seed(*measure(eng, planner, min(B, 16)))
            eng.shapes = planner
        shapes_taken = {}
        segs, last, first, aux = self._prefill(cache, prompts)
        shifted = [t for p, f in zip(prompts, first) for t in p[1:] + [f]]
        eng.extend(segs, torch.tensor(shifted), aux, None, list(enumerate(last)))
        outs = [[t] for t in first]
        lens = [len(p) for p in prompts]
        accept, depths, verified, rows = [], [], [], []
        from ..speculative.engine import STAGES

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
            )
            rounds += 1
            if "shape" in r.plan:
                shapes_taken[r.plan["shape"]] = shapes_taken.get(r.plan["shape"], 0) + 1
            for k in timings:
                timings[k] += r.timings[k]
            rows += [r.plan["verify_rows"] / len(active)] * len(active)  # what the engine ran
            for b, em, n, path, tree in zip(active, r.emitted, r.accept_lens, r.paths, r.trees):
                outs[b] += em
                lens[b] += n
                accept.append(n)
                depths.append(len(path) - 1)
                verified.append(tree.n)
            active = [b for b in active if len(outs[b]) < new_tokens]
        decode_s = time.perf_counter() - t0
        return {
            "outputs": outs,
            "decode_s": decode_s,
            "rounds": rounds,
            "accept": accept,
            "depths": depths,
            "verified": verified,
            "rows": rows,
            "timings": timings,
            "shapes": shapes_taken,
        }


def replay_file(d: str, prompts, refs, tag: str, mode: str = "full") -> str:
    path = os.path.join(d, f"replay-{tag}-{mode}.json")
    with open(path, "w") as f:
        json.dump({"sequences": [p + o for p, o in zip(prompts, refs)], "mode": mode}, f)
    return path


def drafter_factory(name: str, replay_path: str | None):
    from ..speculative.drafters import NextNDrafter, ReplayDrafter

    if name == "nextn":
        return NextNDrafter
    return lambda e: ReplayDrafter(e, replay_path)
