"""Startup with graph capture, inductor's cache cold and warm, through real SGLang servers:

    python -m sglang_dsv4_ascend.bench startup [--method dspark_adaptive] [--bs 1,4]
                                               [--dtype bfloat16] [--cache-dir DIR]

Starts the shipped model's server for one of `bench headline`'s methods (nospec, dspark_adaptive,
nextn_chain, ...) with `--enable-torch-compile --cuda-graph-bs-decode BS` twice
with the same TORCHINDUCTOR_CACHE_DIR (a fresh temporary directory unless --cache-dir names one):
cold (every graph compiled), then warm (inductor loads what the first start compiled, as a server
restarted on the same machine does), then once eager (`--disable-cuda-graph`) for reference. For
each: the wall time from launch to ready, and each capture's log line (its seconds, the memory
it added and inductor's cache hits and misses: device.capture_meter). Each server answers one
greedy request; cold and warm must give the same tokens.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
import time

from .headline import METHODS

CAPTURE = re.compile(
    r"dsv4_ascend: (?P<what>.+?) captured(?: \(torch\.compile, \w+\))? in (?P<s>[\d.]+) s, (?P<mib>[+-][\d.]+) MiB"
    r"(?:, inductor cache: (?P<hit>\d+) hit, (?P<miss>\d+) missed)?"
)
PROMPT = [1, 2, 3, 4, 5, 6, 7, 8]


def captures(log: str) -> list:
    """Each capture line of a server log as {what, s, mib[, cache_hit, cache_missed]}."""
    out = []
    for m in CAPTURE.finditer(log):
        row = {"what": m["what"], "s": float(m["s"]), "mib": float(m["mib"])}
        if m["hit"] is not None:
            row.update(cache_hit=int(m["hit"]), cache_missed=int(m["miss"]))
        out.append(row)
    return out


def start(path: str, args: tuple, env: dict) -> tuple[dict, list]:
    """One server start: (its startup figures and captures, its greedy tokens for PROMPT)."""
    from ..tools.server import SGLangServer

    t0 = time.perf_counter()
    srv = SGLangServer(path, *args, env=env, startup_timeout=3600, zygote=False).start()
    try:
        ready = time.perf_counter() - t0
        tokens = srv.generate(PROMPT, 16, ignore_eos=True)["output_ids"]
        rows = captures(srv.log_text())
    finally:
        srv.stop()
    print(f"startup {ready:.1f} s, {len(rows)} captures", file=sys.stderr)
    return {"startup_s": round(ready, 1), "capture_s": round(sum(r["s"] for r in rows), 1), "captures": rows}, tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_dsv4_ascend.bench startup")
    ap.add_argument("--method", default="dspark_adaptive", choices=sorted(METHODS))
    ap.add_argument("--bs", default="1,4", help="--cuda-graph-bs-decode sizes")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--cache-dir", default=None, help="TORCHINDUCTOR_CACHE_DIR (default: a fresh temporary one)")
    a = ap.parse_args(argv)
    try:
        sizes = [int(x) for x in a.bs.split(",") if x]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        ap.error(f"--bs {a.bs!r}: expected positive batch sizes, e.g. 1,4")
    cache_dir = a.cache_dir or tempfile.mkdtemp(prefix="dsv4_inductor_")
    path, method_env, method_args = METHODS[a.method]
    base = (*method_args, "--dtype", a.dtype)
    graphs = ("--enable-torch-compile", "--cuda-graph-bs-decode", *map(str, sizes))
    env = {**method_env, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    t0 = time.perf_counter()
    result = {
        "bench": "startup",
        "config": {
            "model": "shipped tiny DeepSeek-V4",
            "method": a.method,
            "dtype": a.dtype,
            "graph_flags": " ".join(graphs),
            "compiler": "inductor",
            "cache_dir": cache_dir,
            "machine": platform.machine(),
        },
        "results": {},
    }
    res = result["results"]
    res["cold"], cold_tokens = start(path, base + graphs, env)
    res["warm"], warm_tokens = start(path, base + graphs, env)
    res["eager"], _ = start(path, base + ("--disable-cuda-graph",), env)
    res["warm_tokens_equal_cold"] = warm_tokens == cold_tokens
    res["cold_over_warm"] = round(res["cold"]["startup_s"] / res["warm"]["startup_s"], 2)
    result["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
