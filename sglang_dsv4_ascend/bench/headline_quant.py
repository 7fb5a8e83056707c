"""`bench headline --quant`: the trained tiny model's W8A8 versions beside the float one (#31).

Each W8A8 version is written by tools/quantize_w8a8.py from the shipped checkpoints (the DSpark
one and the NextN one, which share their trunk) into a temporary directory and served with
`--quantization w8a8_ascend` plus the method's own flags (headline.METHODS). QUANTS:

* float: the shipped checkpoints themselves (no --quantization);
* w8a8-dynamic: --scheme dynamic, the draft (mtp.*) W8A8 too: its attention wq_a / wq_b / wkv,
  routed and shared experts and DSpark's main_proj are W8A8_DYNAMIC;
* w8a8-dynamic-float-draft: --scheme dynamic --float-draft (every mtp.* tensor float);
* w8a8-static: --scheme static: the target's dense layers get calibrated per-tensor activations
  (W8A8); the tool keeps the draft's dense layers W8A8_DYNAMIC (the draft is not run during
  calibration), and routed experts and main_proj are W8A8_DYNAMIC under either scheme, so the
  draft is the same kind of W8A8 as under w8a8-dynamic;
* w8a8-static-float-draft: --scheme static --float-draft.

Static calibration: CALIB_PROMPTS packaged first turns taken from the END of the gsm8k /
humaneval / mt-bench files, round-robin (the bench sends each set's first ones), in the chat
format the server renders (`<User>{turn}<Assistant></think>`; the tokenizer adds BOS). Both
static checkpoints (and their DSpark / NextN pair) are calibrated on the same prompts with the
same float trunk, so their target tensors are equal.

Baselines: no speculation runs once per target scheme (float / dynamic / static), on the first
version of that scheme asked for. A W8A8 row's `tok_s_ratio` divides by that no-spec server's
output tok/s at the same dataset and concurrency, measured in the same run. Without speculation a
server runs the trunk only (the trunk skips the mtp.* tensors), so the no-spec server of
w8a8-dynamic is that of w8a8-dynamic-float-draft too: the JSON records each checkpoint's trunk
digest (sha256 over every non-mtp tensor and its description entry) and, per row,
`baseline_same_trunk` (the row's checkpoint's trunk == the baseline's).

Draft quantization effect (`draft_quantization_effect`): per target scheme and method, the accept
length with the W8A8 draft and with the float draft (same target), per dataset and concurrency
(the server's spec_accept_length, mean over requests) and pooled over every verify round of the
run (1 + accepted drafts per round, from the correct-drafts histograms), with the difference.
Under DSpark adaptive verify the planner chooses how many drafts to verify from a cost model each
server measures at startup, and a draft it leaves out counts as rejected, so that figure moves with
the machine's load too; add dspark_static to --methods for the draft's acceptance alone.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections import Counter

import sglang_dsv4_ascend as pkg

QUANT_FLAGS = ("--quantization", "w8a8_ascend")
# name: (scheme: None = the shipped float checkpoints, float draft)
QUANTS = {
    "float": (None, False),
    "w8a8-dynamic": ("dynamic", False),
    "w8a8-dynamic-float-draft": ("dynamic", True),
    "w8a8-static": ("static", False),
    "w8a8-static-float-draft": ("static", True),
}
# what --quant runs unless --methods / --datasets / ... say otherwise: a few minutes on 2 cores
DEFAULTS = {
    "methods": ["nospec", "dspark_adaptive", "nextn_chain"],
    "datasets": ["humaneval"],
    "concurrency": [1, 4],
    "prompts_per_level": 4,
    "max_tokens": 48,
}
CALIB_PROMPTS = 16
SOURCES = {"dspark": pkg.TINY_MODEL_PATH, "nextn": pkg.TINY_NEXTN_MODEL_PATH}


def kind_of(method: str) -> str:
    """Which shipped checkpoint a method serves: the DSpark one (no-spec too) or the NextN one."""
    return "nextn" if method.startswith("nextn") else "dspark"


def scheme_of(quant: str) -> str:
    return QUANTS[quant][0] or "float"


def calibration_file(path: str, n: int = CALIB_PROMPTS) -> str:
    """Write the static scheme's calibration prompts (see the module doc) as JSONL; returns path."""
    from ..data import PROMPT_SETS, load_prompts
    from ..tools.tiny_corpus import ASSISTANT, THINK_END, USER

    sets = [load_prompts(name, None, max_chars=None) for name in PROMPT_SETS]
    texts = []
    for i in range(1, max(map(len, sets)) + 1):
        for s in sets:
            if len(texts) < n and i <= len(s):
                texts.append(f"{USER}{s[-i]}{ASSISTANT}{THINK_END}")
    with open(path, "w") as f:
        for t in texts:
            f.write(json.dumps({"turns": [t]}) + "\n")
    return path


def plan(quants, methods) -> list:
    """The servers, in order: [(key, quant, method, baseline key)]. No-spec runs once per scheme,
    on its first version in QUANTS order; every row of a scheme takes that one as its baseline."""
    quants = [q for q in QUANTS if q in quants]
    methods = ["nospec"] + [m for m in methods if m != "nospec"]
    first = {}
    for q in quants:
        first.setdefault(scheme_of(q), q)
    out = []
    for q in quants:
        base = f"{first[scheme_of(q)]}/nospec"
        for m in methods:
            if m != "nospec" or first[scheme_of(q)] == q:
                out.append((f"{q}/{m}", q, m, base))
    return out


def _description(model_dir: str) -> dict:
    from ..checkpoint import DESCRIPTION_FILE

    path = os.path.join(model_dir, DESCRIPTION_FILE)
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return json.load(f)


def trunk_digest(model_dir: str) -> str:
    """sha256 of every non-mtp tensor (name, dtype, shape, bytes) and its quant description entry."""
    import torch
    from safetensors import safe_open

    from ..checkpoint import shard_files

    desc = _description(model_dir)
    h = hashlib.sha256()
    with contextlib.ExitStack() as stack:
        where = {}  # name -> open shard: the digest does not depend on how the tensors are sharded
        for fname in shard_files(model_dir)[0]:
            f = stack.enter_context(safe_open(os.path.join(model_dir, fname), framework="pt"))
            where.update({n: f for n in f.keys() if not n.startswith("mtp.")})
        for name in sorted(where):
            t = where[name].get_tensor(name)
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|{desc.get(name, 'FLOAT')}|".encode())
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def draft_weights(model_dir: str) -> dict:
    """{ModelSlim type: number of mtp.*.weight tensors of that type} (no description: all FLOAT)."""
    from ..checkpoint import tensor_names

    desc = _description(model_dir)
    names = sorted(n for n in tensor_names(model_dir) if n.startswith("mtp.") and n.endswith(".weight"))
    return dict(sorted(Counter(desc.get(n, "FLOAT") for n in names).items()))


def draft_label(weights: dict) -> str:
    quantized = {t: n for t, n in weights.items() if t != "FLOAT"}
    return "float" if not quantized else "w8a8 (" + ", ".join(f"{t}: {n} weights" for t, n in quantized.items()) + ")"


def checkpoints(quants, kinds, work_dir: str, calib_prompts: int = CALIB_PROMPTS) -> dict:
    """Write the W8A8 versions asked for; {quant: record} with each version's directories
    ({kind: dir}), how it was made, its draft's tensor types and its trunk digests."""
    from ..tools.quantize_w8a8 import quantize_checkpoint

    calib = None
    out = {}
    for q in [q for q in QUANTS if q in quants]:
        scheme, float_draft = QUANTS[q]
        rec = {"scheme": scheme or "float", "float_draft": float_draft, "dirs": {}}
        if scheme == "static" and calib is None:
            calib = calibration_file(os.path.join(work_dir, "calibration.jsonl"), calib_prompts)
        for kind in kinds:
            if scheme is None:
                d = SOURCES[kind]
            else:
                d = os.path.join(work_dir, f"{q}-{kind}")
                quantize_checkpoint(
                    SOURCES[kind],
                    d,
                    scheme,
                    calib=calib if scheme == "static" else None,
                    num_calib=calib_prompts,
                    progress=False,
                    float_draft=float_draft,
                )
            rec["dirs"][kind] = d
        rec["made_by"] = (
            "the shipped checkpoints"
            if scheme is None
            else "tools/quantize_w8a8.quantize_checkpoint(SHIPPED, OUT, scheme="
            f"{scheme!r}{', calib=CALIBRATION, num_calib=%d' % calib_prompts if scheme == 'static' else ''}"
            f", float_draft={float_draft})"
        )
        rec["draft_weights"] = {k: draft_weights(d) for k, d in rec["dirs"].items()}
        rec["draft"] = {k: draft_label(w) for k, w in rec["draft_weights"].items()}
        rec["trunk_sha256"] = {k: trunk_digest(d) for k, d in rec["dirs"].items()}
        out[q] = rec
    return out


def record(info: dict) -> dict:
    """`info` for the JSON: source checkpoints by their package-relative path, no temp dirs."""
    return {
        q: {k: v for k, v in r.items() if k != "dirs"}
        | {"source_checkpoints": {k: os.path.relpath(SOURCES[k], pkg.TINY_MODEL_DIR) for k in r["dirs"]}}
        for q, r in info.items()
    }


def pooled_accept_length(levels) -> float | None:
    """1 + accepted drafts per verify round, over every round of `levels`."""
    hist = [0] * max([len(lv["correct_drafts_histogram"] or []) for lv in levels] or [0])
    for lv in levels:
        for k, v in enumerate(lv["correct_drafts_histogram"] or []):
            hist[k] += v
    rounds = sum(hist)
    return round(1 + sum(k * v for k, v in enumerate(hist)) / rounds, 4) if rounds else None


def draft_effect(results: dict) -> list:
    """W8A8-draft vs float-draft accept length, same target scheme and method (see the module doc)."""
    out = []
    for key, r in results.items():
        q, m = r.get("quant"), r.get("method")
        if m == "nospec" or q is None or QUANTS[q][0] is None or QUANTS[q][1]:
            continue
        fkey = f"{q}-float-draft/{m}"
        if fkey not in results:
            continue
        f = results[fkey]
        a, b = pooled_accept_length(r["levels"]), pooled_accept_length(f["levels"])
        per_level = []
        for lv in r["levels"]:
            other = next(
                (x for x in f["levels"] if (x["dataset"], x["concurrency"]) == (lv["dataset"], lv["concurrency"])),
                None,
            )
            if other is None:
                continue
            x, y = lv["accept_length_mean"], other["accept_length_mean"]
            per_level.append(
                {
                    "dataset": lv["dataset"],
                    "concurrency": lv["concurrency"],
                    "accept_length_w8a8_draft": x,
                    "accept_length_float_draft": y,
                    "change": round(x - y, 4) if x is not None and y is not None else None,
                    "tok_s_w8a8_draft_over_float_draft": round(lv["output_tok_per_s"] / other["output_tok_per_s"], 3)
                    if other["output_tok_per_s"]
                    else None,
                }
            )
        out.append(
            {
                "target": scheme_of(q),
                "method": m,
                "w8a8_draft": key,
                "float_draft": fkey,
                "accept_length_pooled_w8a8_draft": a,
                "accept_length_pooled_float_draft": b,
                "change_pooled": round(a - b, 4) if a is not None and b is not None else None,
                "change_pooled_pct": round(100 * (a - b) / b, 2) if a is not None and b else None,
                "levels": per_level,
            }
        )
    return out


def accept_length_table(results: dict) -> dict:
    """{method: {quant: pooled accept length}}: every version side by side."""
    out = {}
    for r in results.values():
        if r.get("method", "nospec") != "nospec" and "quant" in r:
            out.setdefault(r["method"], {})[r["quant"]] = pooled_accept_length(r["levels"])
    return out


DESCRIPTION = {
    "quant": "per version: scheme, how it was written, its draft's mtp.*.weight tensors by ModelSlim type, "
    "trunk digests (sha256 over every non-mtp tensor and its description entry) of its DSpark and NextN "
    "checkpoints",
    "tok_s_ratio (quant runs)": "output tok/s / the no-spec server's of the same target scheme (results[key]"
    "['baseline']), same dataset and concurrency, same run",
    "baseline_same_trunk": "the row's checkpoint has the baseline checkpoint's trunk digest: the no-spec "
    "server computes the same trunk",
    "accept_length_pooled": "1 + accepted drafts per verify round over every round of the run "
    "(correct_drafts_histogram summed over levels)",
    "draft_quantization_effect": "accept length with the W8A8 draft vs the float draft, same target scheme "
    "and method: per level (spec_accept_length, mean over requests) and pooled. Under DSpark adaptive verify "
    "it also moves with the planner's choices (drafts it leaves out count as rejected; its cost model is "
    "measured at each server's startup, so it differs between servers on a loaded machine): dspark_static, "
    "which verifies every draft, measures the draft alone",
}
