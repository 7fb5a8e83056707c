"""Prefix (radix) cache: time to first token and prefill tokens computed, cold vs a 50 % / 90 %
hit, through one real SGLang server, plus the memory arithmetic of the real configs.

    python -m sglang_dsv4_ascend.bench prefix [--model DIR] [--lengths 2048,4096,8192] [--repeats 3]

For each prompt length: a cold prompt (nothing shared), then for each hit fraction f an earlier
request that shares the first f of the prompt (its own tail differs), then two prompts with that
prefix: the first sharer and a later one. A prompt is sent with max_new_tokens = 1, so its latency
is its time to first token; `cached_tokens` is the server's own count of the hit (the deepest page
boundary with a saved state). When the shared part ends inside a prompt longer than the state
store holds, its boundary's state may be gone by the time the first sharer arrives: that one then
hits less, asks the store to keep the branching point, and later sharers hit it
(kvcache/prefix_state.py, `hint`). Every prompt is new to the server, so a cold run never hits by
accident. Medians over --repeats, ratios to cold in the same run. Memory: bytes per cached token of
the released Flash / Pro configs (bf16) with and without prefix states at the default density,
next to the per-request cost without a cache.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time


def memory(name: str) -> dict:
    import torch

    from ..config import DSV4Config
    from ..kvcache.cache import DSV4Cache
    from ..kvcache.prefix_state import PrefixStates
    from ..names import PAGE_SIZE
    from .cache import CONFIGS

    cfg = DSV4Config.from_hf(CONFIGS[name])
    page, ctx = PAGE_SIZE, 131072
    # entries only: one slot whose rings are excluded, per token slot
    cache = DSV4Cache(cfg, 1, ctx, dtype=torch.bfloat16, device="meta")
    nb = cache.nbytes()
    entries = (nb["c4_kv"] + nb["c4_index"] + nb["c128_kv"]) / cache.num_token_slots
    state = PrefixStates(cache, 1, page).nbytes()
    density = 16  # default: one state per 16 pages of the pool
    return {
        "config": name,
        "entry_bytes_per_token": round(entries, 1),
        "state_bytes": state,
        "state_bytes_per_cached_token_at_default_density": round(state / (density * page), 1),
        "cached_bytes_per_token": round(entries + state / (density * page), 1),
        "request_128k_bytes_without_prefix_cache": int(nb["total"]),
        "request_128k_90pct_hit_reused_bytes": int(entries * 0.9 * ctx + state),
    }


def run(model: str, lengths: list, fractions: list, repeats: int) -> dict:
    import torch

    from ..tools.server import SGLangServer

    gen = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(100, 900, (n,), generator=gen).tolist()

    def ttft(srv, prompt):
        t0 = time.perf_counter()
        out = srv.generate(prompt, 1, ignore_eos=True)
        return time.perf_counter() - t0, out["meta_info"]["cached_tokens"]

    top = max(lengths)
    rows = []
    with SGLangServer(
        model, "--max-total-tokens", str(4 * top + 4096), "--context-length", str(top + 256), startup_timeout=600
    ) as srv:
        srv.generate(ids(64), 1)  # warm up the first forward's one-time costs
        for n in lengths:
            cold = [ttft(srv, ids(n)) for _ in range(repeats)]
            row = {
                "prompt_tokens": n,
                "cold": {
                    "ttft_s": statistics.median(t for t, _ in cold),
                    "prefill_tokens": n - max(c for _, c in cold),
                },
            }
            for f in fractions:
                runs = {"first_sharer": [], "later_sharer": []}
                for _ in range(repeats):
                    shared = ids(int(n * f))
                    srv.generate(shared + ids(n - len(shared)), 1, ignore_eos=True)  # leaves the prefix
                    for who in runs:
                        runs[who].append(ttft(srv, shared + ids(n - len(shared))))
                out = {}
                for who, rr in runs.items():
                    t = statistics.median(x for x, _ in rr)
                    cached = min(c for _, c in rr)
                    out[who] = {
                        "ttft_s": t,
                        "cached_tokens": cached,
                        "prefill_tokens": n - cached,
                        "ttft_ratio_to_cold": round(t / row["cold"]["ttft_s"], 3),
                    }
                row[f"hit_{int(f * 100)}pct"] = out
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    return {"results": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_dsv4_ascend.bench prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the shipped trained tiny model)")
    ap.add_argument("--lengths", default="2048,4096,8192")
    ap.add_argument("--fractions", default="0.5,0.9")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--memory-only", action="store_true", help="only the real-config memory arithmetic")
    a = ap.parse_args(argv)
    out = {"bench": "prefix", "memory": [memory("flash"), memory("pro")]}
    if not a.memory_only:
        import sglang
        import torch

        from .. import TINY_MODEL_PATH

        model = a.model or TINY_MODEL_PATH
        out.update(
            config={
                "model": model,
                "lengths": [int(x) for x in a.lengths.split(",")],
                "fractions": [float(x) for x in a.fractions.split(",")],
                "repeats": a.repeats,
                "max_new_tokens": 1,
                "machine": platform.machine(),
                "cpus": __import__("os").cpu_count(),
                "torch": torch.__version__,
                "sglang": sglang.__version__,
            }
        )
        out.update(run(model, out["config"]["lengths"], out["config"]["fractions"], a.repeats))
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
