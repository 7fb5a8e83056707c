"""Captured vs eager DeepSeek-V4 steps, in process, side by side in one run:

    python -m sglang_dsv4_ascend.bench step --graph [--model shipped|flash|pro] [--batch 1,4]
                                                    [--compiler inductor|aot_eager|eager] [--reps 10]
                                                    [--parts decode,verify,draft]

For each decode batch size: the step as the server runs it eager (a plan built per step), and the
same step captured as SGLang's CPU graph runner captures it (torch.compile of the forward, one
persistent plan per batch size refreshed in place: kvcache/plan.PlanBuffers), with the time the
capture took, the median step times, their ratio, and how far the captured logits are from the
eager ones (max |diff| and whether every row's argmax agrees). The shipped model runs in its own
dtype (bf16); the random presets in fp32. Times are medians of `--reps` after the capture.

`--parts verify,draft` (shipped model, DSpark block 4): per batch size b, the speculative worker's
own captured forwards (speculative/graphs.py) against their eager forms: the target verify of b
whole blocks (b x 5 rows, writes deferred and dropped: VerifyGraphs) and the DSpark draft block
of b requests with its greedy Markov chain (DraftGraphs), each with its capture time.

Decode and verify are captured at SGLANG_DSV4_GRAPH_CONTEXT's bound, as a server captures them
(kvcache/plan.py: committed-entry tables that wide), and where that bound is below `--capacity`
also at the whole cache's width, side by side (`whole_cache_graph_ms`, `whole_cache_capture_s`):
what the bound saves.
"""

from __future__ import annotations

import sys
import time

import torch

from .inproc import median_ms, tiny_model


def _model(name: str):
    from ..models.weights import load_model_from_dir

    if name == "shipped":
        import sglang_dsv4_ascend as pkg

        return load_model_from_dir(pkg.TINY_MODEL_PATH, dtype=torch.bfloat16)
    return tiny_model(name)


def _row(batch, capture_s, eager_ms, graph_ms, eager_logits, graph_logits) -> dict:
    """One batch size's line: times, speedup, and how far the captured logits are from eager's."""
    return {
        "batch": batch,
        "capture_s": round(capture_s, 1),
        "eager_ms": round(eager_ms, 2),
        "graph_ms": round(graph_ms, 2),
        "speedup": round(eager_ms / graph_ms, 2),
        "max_logit_diff": float((graph_logits.float() - eager_logits.float()).abs().max()),
        "argmax_agrees": bool(torch.equal(graph_logits.argmax(-1), eager_logits.argmax(-1))),
    }


def _bound(cache, context: int):
    """The captured forwards' context bound, as the server sets it; refused below the requests'."""
    from .. import settings
    from ..kvcache.plan import graph_context

    bound = graph_context(cache, settings.GRAPH_CONTEXT.get())
    if bound is not None and bound < context:
        raise SystemExit(f"--context {context} is above {settings.GRAPH_CONTEXT.name}={bound}: those steps run eager")
    return bound


def _whole_cache(row, capture_s, graph_ms) -> None:
    row["whole_cache_capture_s"] = round(capture_s, 1)
    row["whole_cache_graph_ms"] = round(graph_ms, 2)
    row["bound_speedup_over_whole_cache"] = round(graph_ms / row["graph_ms"], 2)


def run(model_name: str, batches, compiler: str, context: int, reps: int, capacity: int) -> dict:
    from ..batch import Segment
    from ..kvcache.plan import Bucket, PlanBuffers, build_plan

    model = _model(model_name)
    slots = max(batches) + 1  # slot 0 unused, as SGLang reserves it
    cache = model.make_cache(slots, capacity)
    bound = _bound(cache, context)
    g = torch.Generator().manual_seed(0)
    for s in range(1, slots):
        ids = torch.randint(0, model.cfg.vocab_size, (context,), generator=g)
        model(ids, torch.arange(context), [Segment(s, 0, context)], cache)
    buffers = PlanBuffers(cache)

    def forward(ids, pos, plan):
        return model.compute_logits(model(ids, pos, (), cache, pending=[], plan=plan))

    if compiler == "inductor":
        from ..device import configure_inductor

        configure_inductor()
    captured = torch.compile(torch.no_grad()(forward), dynamic=False, backend=compiler)
    rows = []
    for b in batches:
        segs = [Segment(s, context, 1) for s in range(1, b + 1)]
        ids = torch.randint(0, model.cfg.vocab_size, (b,), generator=g)
        pos = torch.full((b,), context)

        def eager():
            return model.compute_logits(model(ids, pos, segs, cache, pending=[], plan=build_plan(segs, cache)))

        def graph(ctx=bound):
            return captured(ids, pos, buffers.load(segs, Bucket(b, 1, ctx)))

        t0 = time.perf_counter()
        out_g = graph()  # the capture (compilation) happens on the first call
        capture_s = time.perf_counter() - t0
        out_e = eager()
        # both already ran once (the capture, the reference logits): no further warm-up
        eager_ms, graph_ms = median_ms(eager, reps, warmup=False), median_ms(graph, reps, warmup=False)
        row = _row(b, capture_s, eager_ms, graph_ms, out_e, out_g)
        if bound is not None:
            t0 = time.perf_counter()
            graph(None)
            _whole_cache(row, time.perf_counter() - t0, median_ms(lambda: graph(None), reps, warmup=False))
        rows.append(row)
        print(f"batch {b}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "batch"), file=sys.stderr)
    return {"decode": rows}


def run_spec(batches, parts, compiler: str, context: int, reps: int, capacity: int, gamma: int = 4) -> dict:
    import types

    import sglang_dsv4_ascend as pkg

    from ..batch import Segment
    from ..device import configure_inductor
    from ..models.dspark import load_dspark_from_dir
    from ..speculative.drafters import DSparkDrafter
    from ..speculative.engine import SpecEngine
    from ..speculative.graphs import DraftGraphs, VerifyGraphs

    model = _model("shipped")
    draft = load_dspark_from_dir(pkg.TINY_MODEL_PATH, model.cfg, dtype=torch.bfloat16)
    slots = max(batches) + 1
    host = types.SimpleNamespace(model=model, dspark=draft, cfg=model.cfg)
    eng = SpecEngine(
        host,
        model.make_cache(slots, capacity, gamma + 1),
        DSparkDrafter,
        torch.Generator(),
        gamma=gamma,
        topk=1,
        num_steps=gamma,
        num_draft_tokens=gamma + 1,
    )
    cache, layer_ids = eng.cache, eng.drafter.layer_ids
    bound = _bound(cache, context)
    g = torch.Generator().manual_seed(0)
    for s in range(1, slots):  # a context for the target and the draft's rings
        ids = torch.randint(0, model.cfg.vocab_size, (context,), generator=g)
        aux = {"layer_ids": layer_ids}
        model(ids, torch.arange(context), [Segment(s, 0, context)], cache, aux=aux)
        eng.extend([Segment(s, 0, context)], None, aux, None, [])
    if compiler == "inductor":
        configure_inductor()
    compile_fn = lambda f: torch.compile(f, dynamic=False, backend=compiler)  # noqa: E731
    width, out = gamma + 1, {}

    def compare(name, b, capture_s, eager, graph, logits, whole=None):
        eager_ms, graph_ms = median_ms(eager, reps), median_ms(graph, reps)
        row = _row(b, capture_s, eager_ms, graph_ms, logits(eager()), logits(graph()))
        if whole is not None:  # (capture seconds, the forward) at the whole cache's width
            _whole_cache(row, whole[0], median_ms(whole[1], reps))
        out.setdefault(name, []).append(row)
        print(f"{name} {b}: " + ", ".join(f"{k} {v}" for k, v in row.items() if k != "batch"), file=sys.stderr)

    if "verify" in parts:
        for b in batches:
            segs = [Segment(s, context, width) for s in range(1, b + 1)]
            ids = torch.randint(0, model.cfg.vocab_size, (b * width,), generator=g)
            pos = torch.arange(context, context + width).repeat(b)
            captured = {}
            for ctx in [bound] + ([None] if bound is not None else []):
                one = VerifyGraphs(model, cache, width, [b * width], layer_ids, compile_fn, context=ctx)
                t0 = time.perf_counter()
                one.capture(log=lambda msg: None)
                spent = time.perf_counter() - t0
                captured[ctx] = (spent, lambda one=one: one.run(segs, ids, pos, [], {"layer_ids": layer_ids}))

            def eager():
                return model(ids, pos, segs, cache, pending=[], aux={"layer_ids": layer_ids})

            capture_s, graph = captured.pop(bound)
            compare("verify", b, capture_s, eager, graph, model.compute_logits, captured.get(None))
    if "draft" in parts:
        for b in batches:
            one = DraftGraphs(draft, eng.drafter.ctx, gamma, [b], model.embed, model.compute_logits, compile_fn)
            t0 = time.perf_counter()
            one.capture(log=lambda msg: None)
            capture_s = time.perf_counter() - t0
            sl, starts = list(range(1, b + 1)), [context] * b
            anchors = torch.randint(0, model.cfg.vocab_size, (b,), generator=g)

            def eager():  # the block, then the greedy Markov chain, as an eager round drafts
                U, h = draft.block(eng.drafter.ctx, sl, starts, anchors, gamma, model.embed, model.compute_logits)
                return (U, h, *draft.markov_greedy(U, h, anchors))

            def graph():
                return one.run(sl, starts, anchors)

            compare("draft", b, capture_s, eager, graph, lambda uh: uh[0])
    return out
