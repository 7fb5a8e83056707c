"""What the in-process step benchmarks (step.py, graph.py, w8a8.py) share: a tiny random
DeepSeek-V4 of a preset, and the median time of repeated calls."""

from __future__ import annotations

import os
import statistics
import tempfile
import time


def tiny_model(preset: str):
    """Our fp32 trunk of the tiny `preset` (random weights, seed 0, NextN draft)."""
    from ..models.weights import load_model_from_dir
    from ..tools.make_tiny_checkpoint import write_checkpoint

    with tempfile.TemporaryDirectory() as d:
        return load_model_from_dir(write_checkpoint(os.path.join(d, "m"), preset, "nextn"))


def median_ms(fn, reps: int, warmup: bool = True) -> float:
    """Median wall time of `reps` calls of `fn`, in ms, after one untimed call when `warmup`."""
    if warmup:
        fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3
