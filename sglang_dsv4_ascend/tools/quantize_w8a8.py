"""Quantize a bf16 DeepSeek-V4 checkpoint (released tensor names) to a ModelSlim-format W8A8 checkpoint.

    python -m sglang_dsv4_ascend.tools.quantize_w8a8 IN_DIR OUT_DIR [--scheme dynamic|static]
        [--calib prompts.jsonl] [--num-calib N] [--max-calib-tokens T] [--act-sym]
        [--act-percentile P] [--quantize-wo-b]

Which tensors (ModelSlim's V4 recipe, docs/dsv4_reference.md §4.2): attention wq_a, wq_b,
wkv, indexer wq_b and the shared experts' w1/w2/w3 get the chosen scheme; every routed expert
w1/w2/w3 and DSpark main_proj are W8A8_DYNAMIC whatever the scheme (SGLang's NPU int8 MoE is dynamic
only); draft (mtp.*) dense layers stay W8A8_DYNAMIC under --scheme static (the draft is not run
during calibration), and --float-draft keeps every draft tensor float (a W8A8 target with a float
draft: the loader chooses by what the description quantizes); everything else (wo_a, wo_b unless
--quantize-wo-b, compressors, indexer weights_proj, router, embed, head, norms, hc_*, sinks,
Markov/confidence heads) is FLOAT, unchanged.

Weights: per-output-channel symmetric int8, s_w[n] = max_k |W[n, k]| / 127 (fp32),
Wq = clamp(round_half_even(W / s_w), -128, 127); `weight_offset` = 0 (ModelSlim W8A8_DYNAMIC style);
scales/offsets stored fp32 [N, 1].

Static activations (--scheme static): the bf16 model (run in fp32 on CPU) is fed the calibration
prompts (JSONL, {"turns": [...]}: the first turn, tokenized with the checkpoint's tokenizer.json);
each static layer's input range [lo, hi] (min/max, or the --act-percentile of |x| for symmetric /
of x for asymmetric) sets the per-tensor scale and zero point:
    asymmetric (default): s_x = (hi - lo) / 255, o_x = clamp(round(-128 - lo / s_x), -128, 127)
    symmetric (--act-sym): s_x = max(|lo|, |hi|) / 127, o_x = 0
s_x is rounded to bf16 (the dtype SGLang keeps it in); deq_scale = s_x * s_w[n] (fp32);
quant_bias[n] = -o_x * sum_k Wq[n, k] (int32; V4 linears have no float bias).

Output: config.json, tokenizer and every other non-weight file copied; safetensors written with
the input's shard names (and index); quant_model_description.json lists every tensor. A summary
table (stdout) gives each quantized layer's relative Frobenius error of the dequantized weight,
and for calibrated layers the activation range, the fraction of calibration activations clipped,
and the activation quantization error. Same inputs -> byte-identical output.

This builds the whole model in memory only for --scheme static (calibration); --scheme dynamic
streams shard by shard.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from collections import defaultdict
from typing import Optional

import torch

from ..batch import Segment
from ..checkpoint import DESCRIPTION_FILE, INDEX_FILE, shard_files, write_index
from ..models.weights import load_model_from_dir
from ..ops import quant as Q
from ..quantization.w8a8 import FLOAT, V4_RECIPE, W8A8, W8A8_DYNAMIC

_MAX_SAMPLES = 1 << 20  # activation values kept per layer for percentiles / clipping statistics


# ------------------------------------------------------------------------------------------------
# weights


def quantize_weight(w: torch.Tensor):
    """Per-channel symmetric int8: -> (int8 [N, K], scale fp32 [N, 1], offset fp32 [N, 1] zeros,
    relative Frobenius error of the dequantized weight)."""
    w32 = w.float()
    scale = w32.abs().amax(dim=1) / 127.0
    safe = torch.where(scale == 0, torch.ones_like(scale), scale)
    wq = torch.round(w32 / safe[:, None]).clamp(-128, 127).to(torch.int8)
    deq = wq.float() * scale[:, None]
    norm = torch.linalg.vector_norm(w32)
    err = float(torch.linalg.vector_norm(w32 - deq) / norm) if norm > 0 else 0.0
    return wq, scale[:, None].contiguous(), torch.zeros_like(scale)[:, None].contiguous(), err


def scheme_for(name: str, scheme: str, quantize_wo_b: bool = False, float_draft: bool = False) -> Optional[str]:
    """The ModelSlim type of a released weight name under `scheme` ('dynamic' | 'static'), or None (FLOAT)."""
    if float_draft and name.startswith("mtp."):
        return None
    dense = W8A8 if scheme == "static" else W8A8_DYNAMIC
    if V4_RECIPE["routed"].match(name) or V4_RECIPE["draft_proj"].match(name):
        return W8A8_DYNAMIC
    if V4_RECIPE["dense"].match(name) or (quantize_wo_b and V4_RECIPE["wo_b"].match(name)):
        return W8A8_DYNAMIC if name.startswith("mtp.") else dense
    return None


# ------------------------------------------------------------------------------------------------
# calibration


def load_calibration_texts(path: str, n: int) -> list:
    texts = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            obj = json.loads(line)
            turns = obj.get("turns") if isinstance(obj, dict) else None
            if not turns or not isinstance(turns[0], str):
                raise ValueError(f"{path}:{lineno}: expected a JSON object with a non-empty 'turns' list of strings")
            texts.append(turns[0])
            if len(texts) == n:
                break
    if not texts:
        raise ValueError(f"{path}: no calibration prompts")
    return texts


class _ActStats:
    def __init__(self, gen: torch.Generator):
        self.lo, self.hi, self.samples, self.count, self.gen = float("inf"), float("-inf"), [], 0, gen

    def add(self, x: torch.Tensor):
        v = x.detach().float().reshape(-1)
        self.lo, self.hi = min(self.lo, float(v.min())), max(self.hi, float(v.max()))
        self.count += v.numel()
        if v.numel() > _MAX_SAMPLES // 8:
            v = v[torch.randperm(v.numel(), generator=self.gen)[: _MAX_SAMPLES // 8]]
        self.samples.append(v.clone())

    def values(self) -> torch.Tensor:
        v = torch.cat(self.samples)
        if v.numel() > _MAX_SAMPLES:
            v = v[torch.randperm(v.numel(), generator=self.gen)[:_MAX_SAMPLES]]
        return v


def calibrate(
    in_dir: str, layer_names: list, calib_path: str, num_calib: int, max_tokens: int, progress: bool = True
) -> dict:
    """Run the float model on the calibration prompts; {layer prefix: _ActStats} of each layer's input."""
    from tokenizers import Tokenizer
    from tqdm import tqdm

    tok_file = os.path.join(in_dir, "tokenizer.json")
    if not os.path.exists(tok_file):
        raise FileNotFoundError(f"calibration needs the checkpoint's tokenizer: {tok_file} not found")
    tok = Tokenizer.from_file(tok_file)
    texts = load_calibration_texts(calib_path, num_calib)
    model = load_model_from_dir(in_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    stats = {name: _ActStats(gen) for name in layer_names}
    hooks = [
        model.get_submodule(name).register_forward_pre_hook(lambda m, a, n=name: stats[n].add(a[0]))
        for name in layer_names
    ]
    vocab = model.cfg.vocab_size
    try:
        for text in tqdm(texts, desc="calibrating", unit="prompt", disable=not progress, file=sys.stderr):
            ids = [i for i in tok.encode(text).ids if i < vocab][:max_tokens]
            if not ids:
                continue
            ids = torch.tensor(ids)
            cache = model.make_cache(1, len(ids))
            with torch.no_grad():
                model(ids, torch.arange(len(ids)), [Segment(0, 0, len(ids))], cache)
    finally:
        for h in hooks:
            h.remove()
    empty = [n for n, s in stats.items() if s.count == 0]
    if empty:
        raise ValueError(f"calibration saw no activations for {empty[:3]} (all prompts empty after tokenizing?)")
    return stats


def activation_params(st: _ActStats, symmetric: bool, percentile: float):
    """-> (input_scale fp32 [1] (bf16-representable), input_offset fp32 [1], stats dict)."""
    v = st.values()
    if percentile < 100.0:
        q = percentile / 100.0
        if symmetric:
            hi = float(torch.quantile(v.abs(), q))
            lo = -hi
        else:
            lo, hi = float(torch.quantile(v, 1 - q)), float(torch.quantile(v, q))
    else:
        lo, hi = st.lo, st.hi
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    if symmetric:
        s = max(abs(lo), abs(hi)) / 127.0
        off = 0.0
    else:
        s = (hi - lo) / 255.0
    s = s if s > 0 else 1.0
    s = float(torch.tensor(s).to(torch.bfloat16).float())  # the precision SGLang keeps it in
    if not symmetric:
        off = float(min(127, max(-128, round(-128 - lo / s))))
    scale_t, off_t = torch.tensor([s], dtype=torch.float32), torch.tensor([off], dtype=torch.float32)
    q = Q.static_quant(v, scale_t, off_t)
    deq = (q.float() - off) * s
    recip, off_p = Q.static_recip_offset(scale_t, off_t)
    y = v * recip.float() + off_p.float()  # before rounding and saturation
    clip = float(((y >= 127.5) | (y < -128.5)).float().mean())  # would round outside [-128, 127]
    norm = torch.linalg.vector_norm(v)
    err = float(torch.linalg.vector_norm(v - deq) / norm) if norm > 0 else 0.0
    return (
        scale_t,
        off_t,
        {
            "act_lo": lo,
            "act_hi": hi,
            "input_scale": s,
            "input_offset": off,
            "clip_frac": clip,
            "act_rel_err": err,
            "act_count": st.count,
        },
    )


# ------------------------------------------------------------------------------------------------
# checkpoint


def quantize_checkpoint(
    in_dir: str,
    out_dir: str,
    scheme: str = "dynamic",
    calib: Optional[str] = None,
    num_calib: int = 16,
    max_calib_tokens: int = 256,
    act_sym: bool = False,
    act_percentile: float = 100.0,
    quantize_wo_b: bool = False,
    progress: bool = True,
    float_draft: bool = False,
) -> dict:
    """Write the W8A8 checkpoint; returns the summary {"layers": {name: row}, "scheme": ..., ...}."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm import tqdm

    if scheme not in ("dynamic", "static"):
        raise ValueError(f"--scheme must be 'dynamic' or 'static', got {scheme!r}")
    if scheme == "static" and not calib:
        raise ValueError("--scheme static needs calibration prompts: --calib prompts.jsonl")
    if scheme == "dynamic" and calib:
        raise ValueError("--calib is only used by --scheme static (dynamic activations need no calibration)")
    if not 0 < act_percentile <= 100:
        raise ValueError(f"--act-percentile must be in (0, 100], got {act_percentile}")
    if os.path.abspath(in_dir) == os.path.abspath(out_dir):
        raise ValueError("OUT_DIR must differ from IN_DIR")
    files, has_index = shard_files(in_dir)

    names = {}
    for fname in files:
        with safe_open(os.path.join(in_dir, fname), framework="pt") as f:
            for name in f.keys():
                names[name] = fname
    plan = {n: scheme_for(n, scheme, quantize_wo_b, float_draft) for n in names if n.endswith(".weight")}
    static_layers = sorted(n[: -len(".weight")] for n, t in plan.items() if t == W8A8)
    act = {}
    if static_layers:
        stats = calibrate(in_dir, static_layers, calib, num_calib, max_calib_tokens, progress)
        act = {n: activation_params(stats[n], act_sym, act_percentile) for n in static_layers}

    os.makedirs(out_dir, exist_ok=True)
    for f in sorted(os.listdir(in_dir)):
        src = os.path.join(in_dir, f)
        if os.path.isfile(src) and not f.endswith(".safetensors") and f not in (INDEX_FILE, DESCRIPTION_FILE):
            shutil.copyfile(src, os.path.join(out_dir, f))

    desc, weight_map, rows, total = {}, {}, {}, 0
    bar = tqdm(total=len(names), desc="quantizing", unit="tensor", disable=not progress, file=sys.stderr)
    for fname in files:
        out = {}
        with safe_open(os.path.join(in_dir, fname), framework="pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name)
                typ = plan.get(name)
                if typ is None:
                    if t.dtype == torch.int8 or name.endswith((".weight_scale", ".scale")):
                        raise ValueError(
                            f"{in_dir}/{fname}: tensor {name!r} ({t.dtype}) is already quantized; "
                            "this tool takes a bf16/fp32 checkpoint"
                        )
                    out[name], desc[name] = t, FLOAT
                else:
                    if not t.is_floating_point() or t.dim() != 2:
                        raise ValueError(
                            f"{in_dir}/{fname}: tensor {name!r} ({t.dtype}, {tuple(t.shape)}) is not a "
                            "float matrix; this tool takes a bf16/fp32 checkpoint"
                        )
                    p = name[: -len(".weight")]
                    wq, s, o, err = quantize_weight(t)
                    new = {f"{p}.weight": wq, f"{p}.weight_scale": s, f"{p}.weight_offset": o}
                    row = {"scheme": typ, "shape": list(t.shape), "weight_rel_err": err}
                    if typ == W8A8:
                        s_x, o_x, st = act[p]
                        new[f"{p}.input_scale"], new[f"{p}.input_offset"] = s_x, o_x
                        new[f"{p}.quant_bias"] = (-o_x.long() * wq.long().sum(dim=1)).to(torch.int32)
                        new[f"{p}.deq_scale"] = (s_x * s[:, 0]).float()
                        row.update(st)
                    for k, v in new.items():
                        out[k], desc[k] = v, typ
                    rows[p] = row
                bar.update(1)
        save_file(
            {k: out[k].contiguous() for k in sorted(out)}, os.path.join(out_dir, fname), metadata={"format": "pt"}
        )
        weight_map.update({k: fname for k in out})
        total += sum(v.numel() * v.element_size() for v in out.values())
    bar.close()
    if has_index:
        write_index(out_dir, weight_map, total)
    model_type = W8A8 if scheme == "static" else W8A8_DYNAMIC
    with open(os.path.join(out_dir, DESCRIPTION_FILE), "w") as f:
        json.dump({"model_quant_type": model_type, "version": "1.0.0", **dict(sorted(desc.items()))}, f, indent=2)
        f.write("\n")
    return {
        "scheme": scheme,
        "model_quant_type": model_type,
        "layers": rows,
        "num_tensors_in": len(names),
        "num_tensors_out": len(desc),
    }


# ------------------------------------------------------------------------------------------------
# summary


def _group_key(name: str) -> str:
    parts = name.split(".")
    if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
        i = parts.index("experts")
        parts[i + 1] = "*"
    return ".".join(parts)


def format_summary(summary: dict) -> str:
    """Table: one row per quantized layer (routed experts grouped per layer and projection)."""
    groups = defaultdict(list)
    for name, row in summary["layers"].items():
        groups[_group_key(name)].append(row)
    head = f"{'layer':<44} {'scheme':<13} {'n':>4} {'w_err mean':>10} {'w_err max':>10}"
    calibrated = any("act_rel_err" in r for r in summary["layers"].values())
    if calibrated:
        head += f" {'act range':>22} {'clip %':>8} {'a_err':>8}"
    lines = [head, "-" * len(head)]
    for key in sorted(groups, key=_natural):
        rs = groups[key]
        errs = [r["weight_rel_err"] for r in rs]
        line = f"{key:<44} {rs[0]['scheme']:<13} {len(rs):>4} {sum(errs) / len(errs):>10.5f} {max(errs):>10.5f}"
        if calibrated and "act_rel_err" in rs[0]:
            r = rs[0]
            rng = f"[{r['act_lo']:.3g}, {r['act_hi']:.3g}]"
            line += f" {rng:>22} {100 * r['clip_frac']:>8.4f} {r['act_rel_err']:>8.5f}"
        lines.append(line)
    all_errs = [r["weight_rel_err"] for r in summary["layers"].values()]
    lines.append("-" * len(head))
    if all_errs:
        lines.append(
            f"{len(all_errs)} quantized weights ({summary['scheme']}): mean weight rel. error "
            f"{sum(all_errs) / len(all_errs):.5f}, max {max(all_errs):.5f}"
        )
    return "\n".join(lines)


def _natural(s: str):
    return [int(p) if p.isdigit() else p for p in s.replace("*", "-1").split(".")]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("in_dir")
    ap.add_argument("out_dir")
    ap.add_argument("--scheme", default="dynamic", choices=["dynamic", "static"])
    ap.add_argument("--calib", help='JSONL prompts ({"turns": [...]}) for --scheme static')
    ap.add_argument("--num-calib", type=int, default=16, help="number of calibration prompts (default 16)")
    ap.add_argument("--max-calib-tokens", type=int, default=256, help="tokens per calibration prompt (default 256)")
    ap.add_argument("--act-sym", action="store_true", help="symmetric static activations (zero point 0)")
    ap.add_argument(
        "--act-percentile", type=float, default=100.0, help="activation range percentile (default 100 = min/max)"
    )
    ap.add_argument("--quantize-wo-b", action="store_true", help="also quantize attn.wo_b (the recipe keeps it float)")
    ap.add_argument(
        "--float-draft", action="store_true", help="keep the draft (mtp.*) float: a W8A8 target with a float draft"
    )
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args(argv)
    summary = quantize_checkpoint(
        a.in_dir,
        a.out_dir,
        a.scheme,
        a.calib,
        a.num_calib,
        a.max_calib_tokens,
        a.act_sym,
        a.act_percentile,
        a.quantize_wo_b,
        progress=not a.no_progress,
        float_draft=a.float_draft,
    )
    print(format_summary(summary))
    print(f"wrote ModelSlim {summary['model_quant_type']} checkpoint to {a.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
