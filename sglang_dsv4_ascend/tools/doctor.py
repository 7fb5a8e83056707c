"""`python -m sglang_dsv4_ascend.tools.doctor`: what this installation will do, and whether it can.

Prints the SGLang version and whether it is in the supported range, the components and hooks the
plugin registers (and whether every hook target still has the signature we expect), the active
device family, and whether torch_npu / triton / triton-ascend import. Import checks run in child
processes, because a broken torch_npu can take the importing process down with it.
Exit code 0 when everything needed on this machine is in order, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from .. import settings
from ..checkpoint import INDEX_FILE, read_index


def _import_check(module: str, attr: str = "__version__") -> dict:
    code = f"import {module} as m; print(getattr(m, {attr!r}, 'unknown'))"
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return {"imports": False, "error": "timed out after 120 s"}
    if r.returncode == 0:
        return {"imports": True, "version": r.stdout.strip()}
    err = (r.stderr.strip().splitlines() or ["?"])[-1]
    return {"imports": False, "error": err}


def _triton_ascend_installed() -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("triton-ascend")
        return True
    except PackageNotFoundError:
        return False


# How to turn speculation on for DeepSeek-V4 (what `doctor` shows; README "Use" says the same).
SPECULATIVE = {
    "nextn": {
        "chain": "--speculative-algorithm nextn --speculative-num-steps 3 --speculative-eagle-topk 1 "
        "--speculative-num-draft-tokens 4",
        "tree": "--speculative-algorithm nextn --speculative-num-steps 3 --speculative-eagle-topk 4 "
        "--speculative-num-draft-tokens 8",
        "needs": "a checkpoint with a NextN block (mtp.0.e_proj ...), float weights; greedy or temperature / "
        "top_k / top_p / min_p sampling (penalties, logit bias, grammars, logprobs are refused per request)",
    },
    "dspark": {
        "adaptive": "--speculative-algorithm dspark  (gamma = the checkpoint's dspark_block_size; "
        "--speculative-dspark-block-size N to change it)",
        "static": f"{settings.DSPARK_VERIFY.name}=static --speculative-algorithm dspark",
        "options": "--speculative-dspark-sps-table-path FILE (bench sps; else measured at startup), "
        '--speculative-dspark-confidence-sts-path FILE ({"temperatures": [...]})',
        "needs": "a DSpark checkpoint (dspark_* config fields, mtp.0..2 with main_proj / markov_head / "
        "confidence_head), float weights; same per-request limits as nextn",
        "status": "CPU verified (real server, greedy == no speculation, static and adaptive); NPU unverified",
    },
}


def _tiny_model() -> dict:
    """The shipped trained tiny checkpoint: where it is and whether its files are all there."""
    import sglang_dsv4_ascend as pkg

    out = {"path": pkg.TINY_MODEL_PATH, "nextn_path": pkg.TINY_NEXTN_MODEL_PATH, "sts_path": pkg.TINY_STS_PATH}
    missing = []
    for d in (pkg.TINY_MODEL_PATH, pkg.TINY_NEXTN_MODEL_PATH):
        try:
            index = read_index(d)
        except (OSError, ValueError, KeyError):
            index = None
        if index is None:
            missing.append(os.path.join(d, INDEX_FILE))
            continue
        files = set(index.values())
        missing += [
            os.path.join(d, n)
            for n in sorted(files | {"config.json", "tokenizer.json"})
            if not os.path.exists(os.path.join(d, n))
        ]
    out["present"], out["missing"] = not missing, missing
    return out


def collect() -> dict:
    from sglang_dsv4_ascend import __version__, device, platforms
    from sglang_dsv4_ascend.integration import compat, components, hooks

    v = compat.installed_sglang_version()
    report = {
        "sglang_dsv4_ascend": __version__,
        "sglang": {
            "version": v,
            "supported_range": compat.SUPPORTED_SGLANG_TEXT,
            "supported": compat.version_supported(v),
        },
        "device_family": device.device_family(),
        "platform": platforms.activate() or "SGLang's own (ours stands aside)",
        "kernel_family": device.kernel_family(),
        "components": [name for name, _ in components.COMPONENTS],
        "hooks": [],
        "imports": {
            "torch_npu": _import_check("torch_npu"),
            "triton": _import_check("triton"),
        },
        "triton_ascend_installed": _triton_ascend_installed(),
        "speculative": SPECULATIVE,
        "tiny_model": _tiny_model(),
    }
    if report["sglang"]["supported"]:
        for h in hooks.HOOKS:
            try:
                h.check()
                report["hooks"].append({"name": h.name, "target": h.target, "ok": True})
            except compat.UnsupportedSGLang as e:
                report["hooks"].append({"name": h.name, "target": h.target, "ok": False, "error": str(e)})
    problems = []
    if not report["sglang"]["supported"]:
        problems.append(f"sglang {v} is outside {compat.SUPPORTED_SGLANG_TEXT}: the plugin will refuse to start")
    problems += [f"hook {h['name']}: {h['error']}" for h in report["hooks"] if not h["ok"]]
    if report["device_family"] == "npu" and not report["imports"]["torch_npu"]["imports"]:
        problems.append("torch_npu is installed but does not import (is CANN set up? source set_env.sh)")
    npu = report["imports"]["torch_npu"]
    if report["device_family"] != "npu" and not npu["imports"] and not npu["error"].startswith("ModuleNotFoundError"):
        problems.append("a broken torch_npu is installed on a non-NPU machine: uninstall it")
    if report["device_family"] != "npu" and report["triton_ascend_installed"]:
        problems.append("triton-ascend is installed on a non-NPU machine: it replaces triton's files; reinstall triton")
    if not report["tiny_model"]["present"]:
        problems.append(f"the shipped tiny model is incomplete: missing {', '.join(report['tiny_model']['missing'])}")
    report["problems"] = problems
    report["ok"] = not problems
    return report


def ranks_report(ranks: int, ep: int = 1, model: str | None = None, dp: int = 1) -> dict:
    """Each rank's coordinates under --tp-size `ranks` --ep-size `ep` (and, with dp > 1,
    --dp-size dp --enable-dp-attention) as the server logs them at startup, and why the model
    cannot take that layout, if it cannot. `model`: a checkpoint dir, a published config name
    (flash / pro), or the shipped tiny model."""
    from ..config import DSV4Config
    from ..distributed.layout import Layout, layout_problems

    if model in (None, "tiny"):
        from .. import TINY_MODEL_PATH as model
    if model in ("flash", "pro"):
        from ..bench.cache import CONFIGS

        raw = CONFIGS[model]
    else:
        with open(os.path.join(model, "config.json")) as f:
            raw = json.load(f)
    cfg = DSV4Config.from_hf(raw)
    problems = layout_problems(cfg, ranks, ep, dp, enable_dp_attention=dp > 1)
    lays = [] if problems else [Layout.for_flags(ranks, ep, dp, tp_rank=r) for r in range(ranks)]
    flags = f"--tp-size {ranks} --ep-size {ep}" + (f" --dp-size {dp} --enable-dp-attention" if dp > 1 else "")
    H = cfg.num_attention_heads
    return {
        "model": model,
        "flags": flags,
        "ranks": [
            {
                "describe": x.describe(),
                "heads": [x.attn_tp_rank * H // x.attn_tp_size, (x.attn_tp_rank + 1) * H // x.attn_tp_size],
                "experts": [x.experts(cfg.n_routed_experts).start, x.experts(cfg.n_routed_experts).stop],
                "vocab": [x.vocab_rows(cfg.vocab_size).start, x.vocab_rows(cfg.vocab_size).stop],
            }
            for x in lays
        ],
        "problems": problems,
        "ok": not problems,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Check a sglang-dsv4-ascend installation.")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    ap.add_argument(
        "--ranks",
        type=int,
        default=None,
        help="instead: each rank's coordinates under --tp-size RANKS (and --ep-size) for --model",
    )
    ap.add_argument("--ep-size", type=int, default=1, help="with --ranks: the MoE expert-parallel size")
    ap.add_argument(
        "--dp-size",
        type=int,
        default=1,
        help="with --ranks: DP attention (--dp-size D --enable-dp-attention; attention TP = RANKS / D)",
    )
    ap.add_argument(
        "--model", default=None, help="with --ranks: a checkpoint dir, flash, pro (default: the tiny model)"
    )
    a = ap.parse_args(argv)
    if a.ranks is not None:
        r = ranks_report(a.ranks, a.ep_size, a.model, a.dp_size)
        if a.json:
            print(json.dumps(r, indent=2))
        else:
            print(f"{r['model']}: {r['flags']}")
            for x in r["ranks"]:
                print(
                    f"  {x['describe']}; heads [{x['heads'][0]}, {x['heads'][1]}), experts "
                    f"[{x['experts'][0]}, {x['experts'][1]}), vocab rows [{x['vocab'][0]}, {x['vocab'][1]})"
                )
            for p in r["problems"]:
                print(f"PROBLEM: {p}")
            print("OK" if r["ok"] else "NOT OK")
        return 0 if r["ok"] else 1
    r = collect()
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        s = r["sglang"]
        print(f"sglang-dsv4-ascend {r['sglang_dsv4_ascend']}")
        print(
            f"sglang            {s['version']}  ({'supported' if s['supported'] else 'NOT supported'}; "
            f"supported: {s['supported_range']})"
        )
        print(f"device family     {r['device_family']}  (kernels: {r['kernel_family']})")
        print(f"platform          {r['platform']}")
        print(f"components        {', '.join(r['components']) or '(none)'}")
        for h in r["hooks"]:
            print(f"hook              {h['name']} -> {h['target']}: {'ok' if h['ok'] else h['error']}")
        if not r["hooks"]:
            print(
                "hooks             (none)" if s["supported"] else "hooks             (not checked: unsupported sglang)"
            )
        for mod, res in r["imports"].items():
            print(f"import {mod:<11} {'ok ' + res['version'] if res['imports'] else 'no (' + res['error'] + ')'}")
        print(f"triton-ascend     {'installed' if r['triton_ascend_installed'] else 'not installed'}")
        tm = r["tiny_model"]
        print(
            f"tiny model        {tm['path']} ({'present' if tm['present'] else 'INCOMPLETE'}; "
            f"NextN variant {tm['nextn_path']})"
        )
        nx = r["speculative"]["nextn"]
        print(f"speculative nextn chain: {nx['chain']}")
        print(f"                  tree:  {nx['tree']}")
        print(f"                  needs: {nx['needs']}")
        ds = r["speculative"]["dspark"]
        print(f"speculative dspark adaptive: {ds['adaptive']}")
        print(f"                  static:   {ds['static']}")
        print(f"                  options:  {ds['options']}")
        print(f"                  needs:    {ds['needs']}")
        print(f"                  status:   {ds['status']}")
        for p in r["problems"]:
            print(f"PROBLEM: {p}")
        print("OK" if r["ok"] else "NOT OK")
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
