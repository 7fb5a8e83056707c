"""W8A8 INT8 GEMMs of DeepSeek-V4-Flash: quantization error and time of each implementation family
present on this machine, side by side in one run.

    python -m sglang_dsv4_ascend.bench w8a8 [--m 1,16,128,512] [--shapes wq_a,wq_b,...] [--reps N] [--quick]

For each GEMM shape (K -> N) and token count M, with x ~ N(0, 1) in bf16 and W ~ N(0, 1/K) (bf16,
quantized per output channel to int8 exactly as tools/quantize_w8a8.py does):
* error: relative Frobenius error ||y - y_fp32|| / ||y_fp32|| of the bf16 GEMM and of the W8A8 path
  (per-token dynamic int8 activations, bf16 output), against the fp32 GEMM of the same bf16 values;
* time (median of --reps, ms) of: fp32 GEMM, bf16 GEMM, and the reference W8A8 path
  (ops.quant.dynamic_quant + quant_matmul, bf16 out) with its two exact integer products: the
  provable fp32/fp64 GEMM ('float') and torch._int_mm ('int_mm'), and 'auto' with the method its
  timed probe chose for this (M, K) class and why (`ops.quant.int8_method`); plus whether the two
  exact products agree bit for bit (they must).
Families that cannot run here are listed as skipped with the reason (Triton needs a GPU: the
interpreter is a correctness tool, far too slow to time; torch_npu needs an Ascend NPU).

Shapes (Flash, reference §1.1): wq_a 4096->1024, wq_b 1024->32768, wkv 4096->512,
wo_a 8 groups of 4096->1024 (timed as one 4096->8192 GEMM: same FLOPs), wo_b 8192->4096,
expert w1/w3 4096->2048, expert w2 2048->4096.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time

import torch

from .. import settings
from .inproc import median_ms

SHAPES = {  # name: (K, N)
    "wq_a": (4096, 1024),
    "wq_b": (1024, 32768),
    "wkv": (4096, 512),
    "wo_a": (4096, 8192),
    "wo_b": (8192, 4096),
    "expert_w1_w3": (4096, 2048),
    "expert_w2": (2048, 4096),
}
DEFAULT_M = (1, 16, 128, 512)


def _cpu_info() -> dict:
    info = {"processor": platform.processor() or platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
        for line in text.splitlines():
            if line.startswith("model name"):
                info["model"] = line.split(":", 1)[1].strip()
                break
        flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
        info["isa"] = sorted(
            f
            for f in flags
            if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_int8", "amx_bf16")
        )
    except OSError:
        pass
    return info


def _rel(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(y.float() - ref) / torch.linalg.vector_norm(ref))


def _families() -> dict:
    out = {"reference": "ran"}
    if torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
        out["triton"] = "not timed by this CPU benchmark (GPU present: extend here)"
    else:
        out["triton"] = "skipped: no GPU; the Triton interpreter (TRITON_INTERPRET=1) is far too slow to time"
    out["npu"] = (
        "skipped: torch_npu installed but this benchmark does not drive an NPU yet"
        if importlib.util.find_spec("torch_npu") is not None
        else "skipped: torch_npu not installed"
    )
    return out


def run(shapes, ms, reps: int, seed: int = 0) -> dict:
    from ..ops import quant as Q
    from ..tools.quantize_w8a8 import quantize_weight

    results = []
    g = torch.Generator().manual_seed(seed)
    for name in shapes:
        K, N = SHAPES[name]
        w16 = (torch.randn(N, K, generator=g) * K**-0.5).bfloat16()
        w32 = w16.float()
        wq, ws, _, w_err = quantize_weight(w16)
        ws = ws[:, 0]
        for M in ms:
            x16 = torch.randn(M, K, generator=g).bfloat16()
            x32 = x16.float()
            ref = x32 @ w32.t()
            y16 = x16 @ w16.t()

            def w8a8(method):
                xq, xs = Q.dynamic_quant(x16)
                return Q.quant_matmul(xq, wq, ws, xs, out_dtype=torch.bfloat16, method=method)

            y8 = w8a8("float")
            row = {
                "shape": name,
                "K": K,
                "N": N,
                "M": M,
                "rel_err": {"bf16": _rel(y16, ref), "w8a8": _rel(y8, ref), "weight_int8": w_err},
                "time_ms": {
                    "fp32_matmul": median_ms(lambda: x32 @ w32.t(), reps),
                    "bf16_matmul": median_ms(lambda: x16 @ w16.t(), reps),
                    "w8a8_float_exact": median_ms(lambda: w8a8("float"), reps),
                },
                "float_exact_accumulation": "fp32 GEMM (K <= 1024)" if K <= Q.FP32_EXACT_MAX_K else "fp64 GEMM",
            }
            chosen = Q.int8_method(x16.device, M, K, N)  # what 'auto' runs for this shape, and why
            row["auto"] = {"method": chosen, "why": Q.int8_choices()[Q.shape_class(x16.device, M, K, N)]["why"]}
            row["time_ms"]["w8a8_auto"] = median_ms(lambda: w8a8("auto"), reps)
            try:
                y_int = w8a8("int_mm")
                row["time_ms"]["w8a8_torch_int_mm"] = median_ms(lambda: w8a8("int_mm"), reps)
                row["int_mm_bit_equal_float_exact"] = bool(torch.equal(y_int, y8))
            except (RuntimeError, ValueError) as e:  # e.g. a backend without int8 mm
                row["time_ms"]["w8a8_torch_int_mm"] = None
                row["int_mm_error"] = str(e)[:200]
            results.append(row)
            print(
                f"{name:>13} M={M:<4} "
                + " ".join(f"{k}={v:.2f}ms" for k, v in row["time_ms"].items() if v)
                + f" err bf16={row['rel_err']['bf16']:.2e} w8a8={row['rel_err']['w8a8']:.2e}",
                file=sys.stderr,
            )
    return {"results": results}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="token counts (default 1,16,128,512)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions (median), after one warm-up")
    ap.add_argument("--quick", action="store_true", help="M in 1,16 and 1 repetition (smoke run)")
    ap.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    a = ap.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad:
        ap.error(f"unknown shape(s) {bad}; choose from {list(SHAPES)}")
    ms = [1, 16] if a.quick else [int(m) for m in a.m.split(",") if m]
    reps = 1 if a.quick else a.reps
    if a.threads:
        torch.set_num_threads(a.threads)
    from .. import device

    t0 = time.perf_counter()
    out = {
        "bench": "w8a8",
        "config": {
            "machine": _cpu_info(),
            "os": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "device_family": device.device_family(),
            "kernel_family": device.kernel_family(),
            "families": _families(),
            "reps": reps,
            "M": ms,
            "shapes": {s: SHAPES[s] for s in shapes},
            "inputs": "x ~ N(0,1) bf16, W ~ N(0,1/K) bf16, per-channel symmetric int8 weights, per-token int8 x",
            "env": {k: os.environ[k] for k in ("OMP_NUM_THREADS", settings.FORCE_REFERENCE.name) if k in os.environ},
        },
    }
    out.update(run(shapes, ms, reps))
    out["wall_s"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
