"""In-process DeepSeek-V4 forward steps on the tiny model: decode at several batch sizes and
speculative-verify widths, for the per-segment reference forward and the batched forward side by
side in one run, as ratios to size 1, with host syncs per forward and the mHC share of the step.

    python -m sglang_dsv4_ascend.bench step [--preset flash|pro] [--batch 1,4,16,64] [--verify 1,4,8]
                                           [--context 200] [--reps 5] [--threads N]
    python -m sglang_dsv4_ascend.bench step --graph ...   (captured vs eager decode, DSpark verify and
                                                           draft: bench/graph.py)

Each request slot first holds `--context` committed tokens (one prefill each). A decode step is one
forward of B segments of one token; a verify step is one forward of one segment of w tokens. Writes
are deferred and dropped, so every timed step sees the same cache. "reference" is the definition
(SGLANG_DSV4_ATTENTION=segments: attention, compressors and indexer per request, MoE per active
expert); "batched" is the default path (one ForwardPlan per forward, a fixed number of batched ops
per layer, grouped MoE), its plan built inside the timed step as the backend builds it. Host syncs
are counted inside the layers (tools/host_sync.py) on the largest decode batch. The mHC share
wraps `ops.mhc_weights` with a timer. Times are medians of `--reps` after one warm-up, in ms.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from .. import settings
from .inproc import median_ms, tiny_model


class _Timed:
    """Wraps an op to add up the wall time spent in it."""

    def __init__(self, fn):
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *a, **k):
        t0 = time.perf_counter()
        out = self.fn(*a, **k)
        self.seconds += time.perf_counter() - t0
        return out


def run(preset: str, batches, widths, context: int, reps: int) -> dict:
    from .. import ops
    from ..batch import Segment
    from ..kvcache.plan import build_plan
    from ..layers.moe import MoE
    from ..tools.host_sync import count_host_syncs

    model = tiny_model(preset)
    slots = max(batches)
    cache = model.make_cache(slots, context + max(widths) + 1)
    g = torch.Generator().manual_seed(0)
    for s in range(slots):
        ids = torch.randint(0, model.cfg.vocab_size, (context,), generator=g)
        model(ids, torch.arange(context), [Segment(s, 0, context)], cache)

    def step(segs, batched):
        ids = torch.randint(0, model.cfg.vocab_size, (sum(x.length for x in segs),), generator=g)
        pos = torch.cat([torch.arange(x.start, x.start + x.length) for x in segs])

        def fn():
            plan = build_plan(segs, cache) if batched else None
            return model.compute_logits(model(ids, pos, segs, cache, pending=[], plan=plan))

        return fn

    cases = [("decode", b, [Segment(s, context, 1) for s in range(b)]) for b in batches]
    cases += [("verify", w, [Segment(0, context, w)]) for w in widths]
    original_mhc, original_moe = ops.mhc_weights, MoE.forward
    out, syncs = {}, {}
    try:
        for name in ("reference", "batched"):
            batched = name == "batched"
            model.attention_impl = "batched" if batched else "segments"
            MoE.forward = original_moe if batched else MoE.forward_per_expert
            rows = []
            for kind, size, segs in cases:
                timed = _Timed(original_mhc)
                ops.mhc_weights = timed
                fn = step(segs, batched)
                fn()  # warm-up (TorchScript profiles its first runs)
                timed.seconds = 0.0
                ms = median_ms(fn, reps)
                mhc_ms = timed.seconds * 1e3 / (reps + 1)
                rows.append(
                    {
                        "kind": kind,
                        "size": size,
                        "step_ms": round(ms, 3),
                        "mhc_ms": round(mhc_ms, 3),
                        "mhc_share": round(mhc_ms / ms, 3),
                    }
                )
            ops.mhc_weights = original_mhc
            with count_host_syncs(model.layers) as counts:
                step(cases[len(batches) - 1][2], batched)()
            syncs[name] = {"decode_batch": max(batches), "total": sum(counts.values()), "by_op": dict(counts)}
            for kind in ("decode", "verify"):
                base = next(r["step_ms"] for r in rows if r["kind"] == kind)
                for r in rows:
                    if r["kind"] == kind:
                        r["ratio_to_size_1"] = round(r["step_ms"] / base, 3)
            out[name] = rows
            print(
                f"{name}: "
                + ", ".join(f"{r['kind']}{r['size']} {r['step_ms']:.1f}ms x{r['ratio_to_size_1']}" for r in rows)
                + f"; host syncs {syncs[name]['total']}",
                file=sys.stderr,
            )
    finally:
        ops.mhc_weights, MoE.forward = original_mhc, original_moe
        model.attention_impl = "batched"
    ref = {(r["kind"], r["size"]): r["step_ms"] for r in out["reference"]}
    for r in out["batched"]:
        r["speedup_vs_reference"] = round(ref[(r["kind"], r["size"])] / r["step_ms"], 3)
    return {"steps": out, "host_syncs_per_forward": syncs}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="flash", choices=["flash", "pro"])
    ap.add_argument("--batch", default="1,4,16,64", help="decode batch sizes")
    ap.add_argument("--verify", default="1,4,8", help="verify widths (tokens of one request)")
    ap.add_argument("--context", type=int, default=200, help="committed tokens per request")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    ap.add_argument("--graph", action="store_true", help="captured vs eager steps (bench/graph.py)")
    ap.add_argument("--model", default=None, choices=["shipped", "flash", "pro"], help="with --graph (default shipped)")
    ap.add_argument("--compiler", default="inductor", choices=["inductor", "aot_eager", "eager"], help="with --graph")
    ap.add_argument(
        "--capacity", type=int, default=32768, help="with --graph: the cache's context length (the server's on CPU)"
    )
    ap.add_argument(
        "--parts",
        default="decode",
        help="with --graph: any of decode,verify,draft (verify and draft: DSpark's, block 4, shipped model only)",
    )
    a = ap.parse_args(argv)
    if a.graph:
        return _graph_main(a, ap)
    batches = [int(x) for x in a.batch.split(",") if x]
    widths = [int(x) for x in a.verify.split(",") if x]
    if not batches or min(batches) < 1 or not widths or min(widths) < 1 or a.context < 1 or a.reps < 1:
        ap.error("--batch / --verify need positive sizes, --context and --reps positive integers")
    if 1 not in batches or 1 not in widths:
        ap.error("--batch and --verify must include 1 (the ratios are to size 1)")
    if a.threads:
        torch.set_num_threads(a.threads)
    from .. import device

    t0 = time.perf_counter()
    result = {
        "bench": "step",
        "config": {
            "preset": a.preset,
            "dtype": "float32",
            "context": a.context,
            "batch": batches,
            "verify": widths,
            "reps": a.reps,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
            "kernel_family": device.kernel_family(),
        },
        "results": run(a.preset, batches, widths, a.context, a.reps),
    }
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(result, indent=2))
    return 0


def _graph_main(a, ap) -> int:
    from . import graph

    batches = [int(x) for x in a.batch.split(",") if x] if a.batch != "1,4,16,64" else [1, 4]
    if not batches or min(batches) < 1 or a.context < 1 or a.reps < 1:
        ap.error("--batch needs positive sizes, --context and --reps positive integers")
    if a.threads:
        torch.set_num_threads(a.threads)
    model = a.model or "shipped"
    parts = [p for p in a.parts.split(",") if p]
    if not parts or set(parts) - {"decode", "verify", "draft"}:
        ap.error(f"--parts {a.parts}: expected some of decode,verify,draft")
    if set(parts) & {"verify", "draft"} and model != "shipped":
        ap.error("--parts verify / draft: the shipped model only (the random presets have no trained DSpark draft)")
    t0 = time.perf_counter()
    result = {
        "bench": "step --graph",
        "config": {
            "model": model,
            "dtype": "bfloat16" if model == "shipped" else "float32",
            "compiler": a.compiler,
            "capacity": a.capacity,
            "context": a.context,
            "graph_context": settings.GRAPH_CONTEXT.get(),
            "batch": batches,
            "parts": parts,
            "reps": a.reps,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
            "processor": platform.processor(),
        },
        "results": {},
    }
    if "decode" in parts:
        result["results"].update(graph.run(model, batches, a.compiler, a.context, a.reps, a.capacity))
    if set(parts) & {"verify", "draft"}:
        result["results"].update(graph.run_spec(batches, parts, a.compiler, a.context, a.reps, a.capacity))
    result["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
