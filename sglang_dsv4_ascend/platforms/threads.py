"""Thread counts for the CPU reference platform's processes (no SGLang imports: unit-testable)."""

from __future__ import annotations

import os

from .. import settings

BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"  # SGLang's: the cores of each rank, "0-3|4-7"


def _cores() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def rank_core_bind(ranks: int, cores: list[int] | None = None) -> str:
    """SGLang's per-rank core list for `ranks` ranks on this process's cores: contiguous equal
    shares when there are enough cores, else ranks share cores round-robin (a CPU test of a
    layout, not a fast one)."""
    if cores is None:
        cores = _cores()
    if ranks <= len(cores):
        per = len(cores) // ranks
        parts = [cores[i * per : (i + 1) * per] for i in range(ranks)]
    else:
        parts = [[cores[i % len(cores)]] for i in range(ranks)]
    return "|".join(",".join(map(str, p)) for p in parts)


def scheduler_threads(cores: int | None = None, ranks: int = 1) -> int:
    """Intra-op threads for a scheduler process: every core but one, shared among the ranks.

    The spare core runs what serves the model beside it: the HTTP/tokenizer process and the
    detokenizer (and, in the tests, the client). Measured on the 2-core CI machine (tiny flash
    model, fp32, 64 new tokens per request, best of 3): 1 thread 61 / 216 tok/s at concurrency
    1 / 16, 2 threads 57 / 196; run-to-run spread between server instances there is ~25 %
    (a second 1-thread server gave 55 / 159), so one thread is "not slower" rather than faster.
    The same runs: idle 0.012-0.016 cores with sleep-on-idle, 1.01 without, and no throughput
    cost from sleeping (1 thread without it: 60 / 206)."""
    forced = settings.CPU_THREADS.get()
    if forced is not None:
        return forced
    if cores is None:
        cores = len(_cores())
    return max(1, (cores - 1) // max(1, ranks))
