"""`bench headline`: the project's headline numbers, through real SGLang servers on the shipped
trained tiny DeepSeek-V4 (sglang_dsv4_ascend.TINY_MODEL_PATH), every method side by side in one run.

    python -m sglang_dsv4_ascend.bench headline [--methods nospec,nextn_chain,...]
        [--datasets gsm8k,humaneval,mt-bench] [--concurrency 1,8,16] [--prompts-per-level 4]
        [--max-tokens 64] [--out-dir examples/results] [--no-plot]
        [--quant float,w8a8-dynamic,w8a8-dynamic-float-draft,w8a8-static,w8a8-static-float-draft]
        [--zygote]

Per method (METHODS: no speculation; NextN chain, tree topk 2 and 4, tree topk 2 with its round
shape chosen per round; DSpark static and adaptive verify; every speculative method with the
speculation guard on, as served by default, and NextN tree topk 4 and DSpark static also without it,
`*_unguarded`) one server is started (fp32,
--max-total-tokens 32768), warmed up with one untimed level, then `bench serve`'s streaming
client (bench/serve.run_level: OpenAI chat API, greedy, `stream: true`) runs every dataset at
every concurrency. A level sends max(concurrency, `--prompts-per-level`) requests: each
dataset's first turns in file order. The methods run one
after the other on the same machine and prompts, so their ratios to no-spec (`tok_s_ratio`:
output tok/s of the method / no-spec's at the same dataset and concurrency) are measured side by
side; every figure is one run's measurement, noisy at a few percent, never asserted.

Acceptance is what the server verified: under adaptive verify a draft left out of the verified
rows counts as not accepted, so its per-position figures are lower by construction.

Writes OUT_DIR/headline.json (machine, versions, configuration, every level's bench-serve
summary and the ratios), and with matplotlib OUT_DIR/acceptance_by_position.png (conditional
acceptance per draft position by method, pooled over datasets and levels) and
OUT_DIR/throughput.png (output tok/s and its ratio to no-spec by method and concurrency).

`--quant`: the same methods on W8A8 versions of the model too (bench/headline_quant.py: which
versions, how they are written, each one's no-spec baseline and the draft-quantization figures),
one server per version and method, keyed "VERSION/METHOD"; unless given, --methods
nospec,dspark_adaptive,nextn_chain --datasets humaneval --concurrency 1,4 --max-tokens 48.
Writes OUT_DIR/headline_w8a8.json (and w8a8_*.png), never the default run's files.

`--zygote`: servers are forked from one launcher that imported SGLang once (tools/zygote.py:
what that changes), which saves most of each start (~30 s of imports on a 2-core machine); the
timed levels run in the forked servers as in spawned ones.
"""

from __future__ import annotations

import argparse
import contextlib
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
from . import headline_quant, serve

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
    "nextn_tree2_shapes": (  # the round's shape (tree, chain, no draft) chosen per round
        pkg.TINY_NEXTN_MODEL_PATH,
        {settings.NEXTN_SHAPE.name: "adaptive"},
        _NEXTN + ("--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"),
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
# every speculative method runs with the guard (speculative/guard.py), the default; two without it,
# side by side, show what it changes
METHODS.update(
    {
        f"{name}_unguarded": (METHODS[name][0], {**METHODS[name][1], settings.SPEC_GUARD.name: "0"}, METHODS[name][2])
        for name in ("nextn_tree4", "dspark_static")
    }
)


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


def run_method(name, datasets, levels, per_level, max_tokens, path=None, extra_flags=(), label=None) -> dict:
    """One server for METHODS[name] (on `path` instead of its checkpoint, with `extra_flags` after
    its own when given), warmed up, then every dataset at every concurrency."""
    from ..tools.server import SGLangServer

    own_path, env, flags = METHODS[name]
    path, flags = path or own_path, tuple(flags) + tuple(extra_flags)
    out = {"checkpoint": os.path.relpath(path, pkg.TINY_MODEL_DIR), "env": env, "flags": list(flags), "levels": []}
    with SGLangServer(path, *POOL, *flags, env=env, startup_timeout=300) as srv:
        print(f"[headline] {label or name}: server up ({' '.join(flags) or 'no speculation'})", file=sys.stderr)
        if extra_flags or label:
            out["launched_by"] = srv.launched_by
        model = serve.first_model(srv.url, 30)
        warm = load_prompts(datasets[0], None, max_chars=None)
        _level(srv.url, model, warm, max(levels), max(levels), 16)  # untimed: first-run compilation
        for ds in datasets:
            prompts = load_prompts(ds, None, max_chars=None)
            for c in levels:
                lv = _level(srv.url, model, prompts, c, max(c, per_level), max_tokens)
                out["levels"].append({"dataset": ds, **lv})
        rec = speculative_record(srv.server_info())
        if rec:
            out["speculative_record"] = rec
    return out


SPEC_RECORD_KEYS = (
    "rounds",
    "skipped_draft_rounds",
    "rounds_by_guard",
    "guard_by_batch",
    "rounds_by_shape",
    "stage_ms_per_round",
    "round_ms_by_batch",
)


def speculative_record(info: dict) -> dict | None:
    """The speculative worker's record at the end of a method's run (warm-up included), from
    /get_server_info: its rounds, why it drafted or not (speculative/guard.py: each batch-size
    class's drafting-over-plain ratio), its stage times and predicted vs measured round times."""
    for state in info.get("internal_states") or []:
        rec = state.get("dspark_info_record") or state.get("nextn_info_record")
        if isinstance(rec, dict):
            return {k: rec[k] for k in SPEC_RECORD_KEYS if k in rec}
    return None


AGAIN = "nospec_again"  # the no-spec server once more, after every other method


def ratios(results: dict) -> list:
    """A row per result and level; tok_s_ratio against the result named by its "baseline" (default
    "nospec") at the same dataset and concurrency. Where no-spec ran again at the end of the run
    (AGAIN), its baseline is the mean of both runs: the machine drifts over a run (one run's
    no-spec server read 21.6 / 96.6 / 121.0 tok/s at 1 / 8 / 16 requests, a check 3.5 minutes later
    19.2 / 83.7 / 103.9), and a baseline taken at one end of it moves every ratio alike."""

    def base(name):
        tps = _tok_s(results.get(name))
        if name == "nospec" and AGAIN in results:
            again = base(AGAIN)
            tps = {k: (v + again[k]) / 2 if k in again else v for k, v in tps.items()}
        return tps

    bases = {}
    rows = []
    for name, r in results.items():
        b_name = r.get("baseline", "nospec")
        if b_name not in bases:
            bases[b_name] = base(b_name)
        for lv in r["levels"]:
            b = bases[b_name].get((lv["dataset"], lv["concurrency"]))
            rows.append(
                {
                    "method": name,
                    **({"quant": r["quant"], "spec_method": r["method"]} if "quant" in r else {}),
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


def _tok_s(result: dict | None) -> dict:
    """(dataset, concurrency) -> output tok/s of one method's result ({} for none)."""
    return {(lv["dataset"], lv["concurrency"]): lv["output_tok_per_s"] for lv in result["levels"]} if result else {}


def baseline_drift(results: dict) -> dict | None:
    """No-spec's tok/s at the end of the run over its tok/s at the start, per dataset and
    concurrency ("dataset@concurrency"): how far the machine moved while the methods ran."""
    if AGAIN not in results or "nospec" not in results:
        return None
    first = _tok_s(results["nospec"])
    return {
        f"{lv['dataset']}@{lv['concurrency']}": round(lv["output_tok_per_s"] / first[k], 3)
        for lv in results[AGAIN]["levels"]
        if (k := (lv["dataset"], lv["concurrency"])) in first and first[k]
    }


def pooled_acceptance(levels) -> list | None:
    """Conditional acceptance per position over every verify round of `levels`."""
    hists = [lv["correct_drafts_histogram"] for lv in levels if lv["correct_drafts_histogram"]]
    if not hists:
        return None
    hist = [sum(h[k] for h in hists if k < len(h)) for k in range(max(map(len, hists)))]
    return serve.acceptance(hist, max(lv["draft_positions"] or 0 for lv in levels))


def plot(report, out_dir, prefix="") -> list:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = [os.path.join(out_dir, f"{prefix}{n}.png") for n in ("acceptance_by_position", "throughput")]
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
    ap.add_argument("--methods", type=_list(str, METHODS), default=None, help="default: every method")
    ap.add_argument("--datasets", type=_list(str, PROMPT_SETS), default=None, help="default: every set")
    ap.add_argument("--concurrency", type=_list(int), default=None, help="default: 1,8,16")
    ap.add_argument("--prompts-per-level", type=int, default=None, help="default: 4")
    ap.add_argument("--max-tokens", type=int, default=None, help="default: 64")
    ap.add_argument("--out-dir", default=os.path.join("examples", "results"))
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument(
        "--quant",
        type=_list(str, headline_quant.QUANTS),
        default=None,
        help="W8A8 versions to run the methods on too (bench/headline_quant.py); other defaults then: "
        + " ".join(
            f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ','.join(map(str, v))}"
            for k, v in headline_quant.DEFAULTS.items()
        ),
    )
    ap.add_argument("--zygote", action="store_true", help="fork the servers from one pre-imported launcher")
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    defaults = (
        headline_quant.DEFAULTS
        if a.quant
        else {
            "methods": list(METHODS),
            "datasets": list(PROMPT_SETS),
            "concurrency": [1, 8, 16],
            "prompts_per_level": 4,
            "max_tokens": 64,
        }
    )
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if any(c <= 0 for c in a.concurrency) or a.prompts_per_level <= 0 or a.max_tokens <= 0:
        ap.error("--concurrency, --prompts-per-level and --max-tokens must be positive")
    os.makedirs(a.out_dir, exist_ok=True)
    t0 = time.time()
    with _launcher(a.zygote):
        if a.quant:
            results, quant = run_quant(a)
        else:
            results = {
                m: run_method(m, a.datasets, a.concurrency, a.prompts_per_level, a.max_tokens) for m in a.methods
            }
            if "nospec" in a.methods and len(a.methods) > 1:  # the baseline bracketing the run
                results[AGAIN] = run_method(
                    "nospec", a.datasets, a.concurrency, a.prompts_per_level, a.max_tokens, label=AGAIN
                )
    config = {k: v for k, v in vars(a).items() if k not in ("no_plot", "quant", "zygote")}
    config |= {"quant": a.quant, "zygote": a.zygote} if a.quant or a.zygote else {}
    report = {
        "bench": "headline",
        "environment": environment(),
        "config": config | {"model": "TINY_MODEL_PATH (trained)", "dtype": "float32", "greedy": True},
        "description": {
            "serve": serve.DESCRIPTION,
            "tok_s_ratio": "output tok/s / no-spec's, same dataset and concurrency, same run (the mean of "
            f"no-spec's two servers, first and last, where {AGAIN} ran)",
            "baseline_drift": f"{AGAIN}'s tok/s / nospec's: how far the machine moved during the run",
        },
        "summary": None,
        "acceptance_by_position": None,
        "results": results,
        "seconds": round(time.time() - t0, 1),
    }
    if a.quant:
        report["environment"]["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS")
        report["description"] |= headline_quant.DESCRIPTION
        report["quant"] = quant
        report["accept_length_pooled"] = headline_quant.accept_length_table(results)
        report["draft_quantization_effect"] = headline_quant.draft_effect(results)
    report["summary"] = ratios(results)
    drift = baseline_drift(results)
    if drift:
        report["baseline_drift"] = drift
    report["acceptance_by_position"] = {
        m: pooled_acceptance(r["levels"]) for m, r in results.items() if r.get("method", m) not in ("nospec", AGAIN)
    }
    prefix = "w8a8_" if a.quant else ""
    if not a.no_plot:
        try:
            report["plots"] = plot(report, a.out_dir, prefix)
        except ImportError:
            print("[headline] matplotlib is not installed: no plots (pip install matplotlib)", file=sys.stderr)
    path = os.path.join(a.out_dir, "headline_w8a8.json" if a.quant else "headline.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
        f.write("\n")
    print(json.dumps(report["summary"], indent=1))
    if a.quant:
        print(json.dumps(report["draft_quantization_effect"], indent=1))
    print(f"[headline] wrote {path}", file=sys.stderr)
    return 0 if not any(r["errors"] for r in report["summary"]) else 1


@contextlib.contextmanager
def _launcher(zygote: bool):
    """With `zygote` (and none named by the environment already): one pre-imported launcher for
    every server of the run (tools/zygote.py), stopped at the end."""
    if not zygote or settings.ZYGOTE.is_set():
        yield
        return
    import tempfile

    from ..tools import zygote as zg

    d = tempfile.mkdtemp(prefix="sglang-dsv4-zygote-")
    proc = zg.start(os.path.join(d, "sock"), os.path.join(d, "zygote.log"))
    os.environ[settings.ZYGOTE.name] = os.path.join(d, "sock")
    try:
        yield
    finally:
        del os.environ[settings.ZYGOTE.name]
        proc.terminate()
        proc.wait(timeout=30)


def run_quant(a) -> tuple:
    """--quant: write the versions, then one server per (version, method) in plan order."""
    import tempfile

    hq = headline_quant
    runs = hq.plan(a.quant, a.methods)
    kinds = sorted({hq.kind_of(m) for _, _, m, _ in runs})
    with tempfile.TemporaryDirectory(prefix="headline-w8a8-") as d:
        info = hq.checkpoints(a.quant, kinds, d)
        for q, r in info.items():
            print(f"[headline] {q}: draft {r['draft']}, trunk {r['trunk_sha256']}", file=sys.stderr)
        results = {}
        for key, q, m, base in runs:
            kind, bq = hq.kind_of(m), base.split("/")[0]
            flags = hq.QUANT_FLAGS if hq.QUANTS[q][0] else ()
            r = run_method(
                m, a.datasets, a.concurrency, a.prompts_per_level, a.max_tokens, info[q]["dirs"][kind], flags, key
            )
            results[key] = {
                "quant": q,
                "method": m,
                "scheme": info[q]["scheme"],
                "draft": None if m == "nospec" else info[q]["draft"][kind],
                "checkpoint": os.path.relpath(hq.SOURCES[kind], pkg.TINY_MODEL_DIR)
                + ("" if q == "float" else f" -> {q} ({info[q]['made_by']})"),
                "baseline": base,
                "baseline_same_trunk": info[q]["trunk_sha256"][kind] == info[bq]["trunk_sha256"]["dspark"],
                **{k: v for k, v in r.items() if k != "checkpoint"},
            }
    return results, hq.record(info)


if __name__ == "__main__":
    sys.exit(main())
