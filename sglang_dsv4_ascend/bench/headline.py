"""`bench headline`: the project's headline numbers, through real SGLang servers on the shipped
trained tiny DeepSeek-V4 (sglang_dsv4_ascend.TINY_MODEL_PATH), every method side by side in one run.

    python -m sglang_dsv4_ascend.bench headline [--methods nospec,nextn_chain,...]
        [--datasets gsm8k,humaneval,mt-bench] [--concurrency 1,8,16] [--prompts-per-level 4]
        [--max-tokens 64] [--out-dir examples/results] [--no-plot]

Per method (METHODS: no speculation; NextN chain, tree topk 2 and 4; DSpark static and adaptive
verify) one server is started (fp32, --max-total-tokens 32768), warmed up with one untimed
level, then `bench serve`'s streaming client (bench/serve.run_level: OpenAI chat API, greedy,
`stream: true`) runs every dataset at every concurrency. A level sends max(concurrency,
`--prompts-per-level`) requests: each dataset's first turns in file order. The methods run one
after the other on the same machine and prompts, so their ratios to no-spec (`tok_s_ratio`:
output tok/s of the method / no-spec's at the same dataset and concurrency) are measured side by
side; every figure is one run's measurement, noisy at a few percent, never asserted.

Acceptance is what the server verified: under adaptive verify a draft left out of the verified
rows counts as not accepted, so its per-position figures are lower by construction.

Writes OUT_DIR/headline.json (machine, versions, configuration, every level's bench-serve
summary and the ratios), and with matplotlib OUT_DIR/acceptance_by_position.png (conditional
acceptance per draft position by method, pooled over datasets and levels) and
OUT_DIR/throughput.png (output tok/s and its ratio to no-spec by method and concurrency).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
import types

import sglang_dsv4_ascend as pkg

from .. import settings
from ..data import PROMPT_SETS, load_prompts
from . import serve

POOL = ("--max-total-tokens", "32768")
_NEXTN = ("--speculative-algorithm", "nextn", "--speculative-num-steps", "3")
# name: (checkpoint, environment, server flags)
METHODS = {
    "nospec": (pkg.TINY_MODEL_PATH, {}, ()),
    "nextn_chain": (
        pkg.TINY_NEXTN_MODEL_PATH,
        {},
        _NEXTN + ("--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"),
    ),
    "nextn_tree2": (
        pkg.TINY_NEXTN_MODEL_PATH,
        {},
        _NEXTN + ("--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"),
    ),
    "nextn_tree4": (
        pkg.TINY_NEXTN_MODEL_PATH,
        {},
        _NEXTN + ("--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"),
    ),
    "dspark_static": (
        pkg.TINY_MODEL_PATH,
        {settings.DSPARK_VERIFY.name: "static"},
        ("--speculative-algorithm", "dspark"),
    ),
    "dspark_adaptive": (
        pkg.TINY_MODEL_PATH,
        {settings.DSPARK_VERIFY.name: "adaptive"},
        ("--speculative-algorithm", "dspark"),
    ),
}


def environment() -> dict:
    import torch

    def version(mod):
        try:
            return __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing package is a fact to record
            return None

    try:
        commit = (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                capture_output=True,
                text=True,
                cwd=os.path.dirname(os.path.abspath(__file__)),
                timeout=10,
            ).stdout.strip()
            or None
        )
    except OSError:
        commit = None
    return {
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpus": os.cpu_count(),
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "sglang": version("sglang"),
        "transformers": version("transformers"),
        "sglang_dsv4_ascend": pkg.__version__,
        "git_commit": commit,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _client(url, model, max_tokens, n) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        url=url, model=model, max_tokens=max_tokens, temperature=0.0, num_prompts=n, timeout=600.0
    )


def _level(url, model, prompts, c, n, max_tokens) -> dict:
    lv, _ = serve.run_level(_client(url, model, max_tokens, n), prompts, c)
    if lv["errors"]:
        raise RuntimeError(
            f"{lv['errors']} of {lv['requests']} requests failed at concurrency {c}: {lv['first_error']}"
        )
    return lv


def run_method(name, datasets, levels, per_level, max_tokens) -> dict:
    from ..tools.server import SGLangServer

    path, env, flags = METHODS[name]
    out = {"checkpoint": os.path.relpath(path, pkg.TINY_MODEL_DIR), "env": env, "flags": list(flags), "levels": []}
    with SGLangServer(path, *POOL, *flags, env=env, startup_timeout=300) as srv:
        print(f"[headline] {name}: server up ({' '.join(flags) or 'no speculation'})", file=sys.stderr)
        model = serve.first_model(srv.url, 30)
        warm = load_prompts(datasets[0], None, max_chars=None)
        _level(srv.url, model, warm, max(levels), max(levels), 16)  # untimed: first-run compilation
        for ds in datasets:
            prompts = load_prompts(ds, None, max_chars=None)
            for c in levels:
                lv = _level(srv.url, model, prompts, c, max(c, per_level), max_tokens)
                out["levels"].append({"dataset": ds, **lv})
    return out


def ratios(results: dict) -> list:
    base = (
        {(lv["dataset"], lv["concurrency"]): lv["output_tok_per_s"] for lv in results["nospec"]["levels"]}
        if "nospec" in results
        else {}
    )
    rows = []
    for name, r in results.items():
        for lv in r["levels"]:
            b = base.get((lv["dataset"], lv["concurrency"]))
            rows.append(
                {
                    "method": name,
                    "dataset": lv["dataset"],
                    "concurrency": lv["concurrency"],
                    "output_tok_per_s": lv["output_tok_per_s"],
                    "tpot_ms_mean": lv["tpot_ms"]["mean"],
                    "ttft_ms_p50": lv["ttft_ms"]["p50"],
                    "accept_length_mean": lv["accept_length_mean"],
                    "tok_s_ratio": round(lv["output_tok_per_s"] / b, 3) if b else None,
                    "errors": lv["errors"],
                }
            )
    return rows


def pooled_acceptance(levels) -> list | None:
    """Conditional acceptance per position over every verify round of `levels`."""
    hists = [lv["correct_drafts_histogram"] for lv in levels if lv["correct_drafts_histogram"]]
    if not hists:
        return None
    hist = [sum(h[k] for h in hists if k < len(h)) for k in range(max(map(len, hists)))]
    return serve.acceptance(hist, max(lv["draft_positions"] or 0 for lv in levels))


def plot(report, out_dir) -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [os.path.join(out_dir, "acceptance_by_position.png"), os.path.join(out_dir, "throughput.png")]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, acc in report["acceptance_by_position"].items():
        if acc:
            ax.plot(range(1, len(acc) + 1), acc, marker="o", label=name)
    n = max((len(a) for a in report["acceptance_by_position"].values() if a), default=1)
    ax.set_xticks(range(1, n + 1))
    ax.set(
        xlabel="draft position",
        ylabel="P(accepted | previous accepted)",
        ylim=(0, 1.02),
        title="per-position acceptance (trained tiny DSV4, all datasets)",
    )
    ax.legend()
    fig.tight_layout()
    fig.savefig(paths[0])
    rows, levels = report["summary"], report["config"]["concurrency"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for name in report["results"]:
        mean = lambda key, c: [r[key] for r in rows if r["method"] == name and r["concurrency"] == c and r[key]]
        tps = [sum(v) / len(v) if (v := mean("output_tok_per_s", c)) else None for c in levels]
        rat = [sum(v) / len(v) if (v := mean("tok_s_ratio", c)) else None for c in levels]
        axes[0].plot(levels, tps, marker="o", label=name)
        axes[1].plot(levels, rat, marker="o", label=name)
    axes[0].set(xlabel="concurrency", ylabel="output tok/s (mean over datasets)", title="throughput")
    axes[1].set(xlabel="concurrency", ylabel="ratio to no-spec", title="speed-up over no speculation")
    axes[1].axhline(1.0, color="grey", lw=0.8)
    for ax in axes:
        ax.set_xscale("log")
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.minorticks_off()
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths[1])
    plt.close("all")
    return paths


def _list(kind, allowed=None):
    def conv(s):
        items = [x.strip() for x in s.split(",") if x.strip()]
        bad = [x for x in items if allowed is not None and x not in allowed]
        if not items or bad:
            raise argparse.ArgumentTypeError(
                f"{s!r}: expected a comma list of {', '.join(allowed or ['positive ints'])}"
            )
        return [kind(x) for x in items]

    return conv


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_dsv4_ascend.bench headline", description=__doc__.split("\n")[0])
    ap.add_argument("--methods", type=_list(str, METHODS), default=list(METHODS))
    ap.add_argument("--datasets", type=_list(str, PROMPT_SETS), default=list(PROMPT_SETS))
    ap.add_argument("--concurrency", type=_list(int), default=[1, 8, 16])
    ap.add_argument("--prompts-per-level", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out-dir", default=os.path.join("examples", "results"))
    ap.add_argument("--no-plot", action="store_true")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    if any(c <= 0 for c in a.concurrency) or a.prompts_per_level <= 0 or a.max_tokens <= 0:
        ap.error("--concurrency, --prompts-per-level and --max-tokens must be positive")
    os.makedirs(a.out_dir, exist_ok=True)
    t0 = time.time()
    results = {m: run_method(m, a.datasets, a.concurrency, a.prompts_per_level, a.max_tokens) for m in a.methods}
    report = {
        "bench": "headline",
        "environment": environment(),
        "config": {k: v for k, v in vars(a).items() if k != "no_plot"}
        | {"model": "TINY_MODEL_PATH (trained)", "dtype": "float32", "greedy": True},
        "description": {
            "serve": serve.DESCRIPTION,
            "tok_s_ratio": "output tok/s / no-spec's, same dataset and concurrency, same run",
        },
        "summary": None,
        "acceptance_by_position": None,
        "results": results,
        "seconds": round(time.time() - t0, 1),
    }
    report["summary"] = ratios(results)
    report["acceptance_by_position"] = {m: pooled_acceptance(r["levels"]) for m, r in results.items() if m != "nospec"}
    if not a.no_plot:
        try:
            report["plots"] = plot(report, a.out_dir)
        except ImportError:
            print("[headline] matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
    path = os.path.join(a.out_dir, "headline.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(json.dumps(report["summary"], indent=1))
    print(f"[headline] wrote {path}", file=sys.stderr)
    return 0 if not any(r["errors"] for r in report["summary"]) else 1


if __name__ == "__main__":
    sys.exit(main())
