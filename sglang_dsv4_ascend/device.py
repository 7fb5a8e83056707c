"""The one place that probes the machine: which accelerator stack is installed, which device
family is active and which kernel family runs.

`accelerator()` is the one probe (the platform entry point asks it whether to stand aside);
`device_family()` and `kernel_family()` derive from it. Model and layer code never asks "is this
an NPU?"; it calls ops through `sglang_dsv4_ascend.ops`, which dispatch on `kernel_family()`.

    SGLANG_DSV4_FORCE_REFERENCE=1   run the plain-torch reference ops everywhere (bisecting numerics)
"""

from __future__ import annotations

import functools
import importlib.util

from . import settings


@functools.lru_cache(maxsize=None)
def accelerator() -> str | None:
    """The accelerator stack that owns this machine: 'npu' (torch_npu installed), 'cuda', 'xpu',
    or None. Probes torch_npu by spec only: importing it without CANN breaks `import torch`."""
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    xpu = getattr(torch, "xpu", None)
    if xpu is not None and xpu.is_available():
        return "xpu"
    return None


@functools.lru_cache(maxsize=None)
def device_family() -> str:
    """'npu', 'cuda' or 'cpu' (an XPU runs the CPU kernel family: we have no XPU kernels)."""
    found = accelerator()
    return found if found in ("npu", "cuda") else "cpu"


def force_reference() -> bool:
    return settings.FORCE_REFERENCE.get()


def kernel_family() -> str:
    """'reference', 'cpu', 'triton' or 'npu': which implementation family the hot ops use.
    'cpu' is the reference with dispatch-bound ops compiled (ops/scripted.py) and W8A8 GEMMs on
    the fastest exact method for the machine; 'reference' is the plain definition everywhere."""
    if force_reference():
        return "reference"
    fam = device_family()
    if fam == "npu":
        return "npu"
    if fam == "cuda":
        return "triton"
    return "cpu"


def capture_graph(fn):
    """The device-graph abstraction for the forwards the speculative worker runs itself (the target
    verify, NextN's draft steps, the DSpark draft block): `fn` made replayable at fixed shapes, one
    graph per shape it is called with. On CPU, torch.compile with the compiler
    SGLANG_DSV4_COMPILE_BACKEND names (inductor as configure_inductor sets it, as
    integration/graph_runner.py compiles the plain decode). On CUDA a CUDA graph and on NPU an ACL
    graph per signature (device_graph.DeviceGraphs), UNVERIFIED: never run on either device; the
    worker asks for them there only under SGLANG_DSV4_DEVICE_GRAPHS=1
    (integration/server_defaults.spec_graph_sizes)."""
    import torch

    fam = device_family()
    if fam in ("cuda", "npu"):
        from . import device_graph

        return device_graph.DeviceGraphs(fn, device_graph.cuda_api() if fam == "cuda" else device_graph.npu_api())
    compiler = settings.COMPILE_BACKEND.get()
    if compiler == "inductor":
        configure_inductor()
    return torch.compile(fn, dynamic=False, backend=compiler)


def graph_kind() -> str:
    """What capture_graph makes on this machine, for the startup log."""
    fam = device_family()
    if fam in ("cuda", "npu"):
        return f"{'CUDA' if fam == 'cuda' else 'ACL'} graphs (unverified on this device)"
    return f"torch.compile with {settings.COMPILE_BACKEND.get()}"


def configure_inductor() -> None:
    """Inductor as every DeepSeek-V4 capture uses it (decode, verify, draft; and the benches).

    * Freezing off. SGLang turns it on (weights folded in as constants); compiling the shipped bf16
      DeepSeek-V4 step with it failed here: a frozen weight was bound to the wrong matmul
      ([16, 512] x [64, 128] in the mHC mix). Without it the step compiles and equals eager
      (tests/unit/test_graph_capture.py, bench step --graph).
    * bf16 / fp16 rounded after every op as eager rounds (`emulate_precision_casts`). Fused kernels
      otherwise keep the intermediates in fp32. That is not more accurate here: the captured bf16
      verify of the shipped model was twice as far from an fp32 forward as eager bf16 was (mean
      |logit diff| 0.068 vs 0.034, max 1.14), so greedy with graphs could part from greedy without.
      With it the captured verify equals eager bit for bit, for about 8 % of its step time."""
    from torch._inductor import config as inductor_config

    inductor_config.freezing = False
    inductor_config.emulate_precision_casts = True


def capture_meter():
    """Start measuring one capture; the function returned gives its log figures: the seconds, the
    memory it added (memory_mib) and, when inductor compiled, its FX graph cache hits and misses
    during the capture. A miss is a compilation (minutes per graph on a 2-core CPU), a hit a load
    from the cache in TORCHINDUCTOR_CACHE_DIR (/tmp/torchinductor_$USER unless set; seconds), so
    the log says why a startup was slow and whether the cache it could reuse was there."""
    import time

    tic, mem, cache = time.perf_counter(), memory_mib(), _inductor_cache_counts()

    def spent() -> str:
        hit, miss = (now - then for now, then in zip(_inductor_cache_counts(), cache))
        text = f"{time.perf_counter() - tic:.1f} s, {memory_mib() - mem:+.1f} MiB"
        return text + (f", inductor cache: {hit} hit, {miss} missed" if hit or miss else "")

    return spent


def _inductor_cache_counts() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"], counters["inductor"]["fxgraph_cache_miss"]


def memory_mib() -> float:
    """Memory this process holds where its tensors live, in MiB, for capture logs: on CPU the
    resident set (/proc/self/statm; the peak, from getrusage, where there is no /proc); on CUDA
    the allocator's allocated bytes. On an NPU it reports the host's resident set too (torch_npu's
    allocator is not read: this module must not import it)."""
    if device_family() == "cuda":
        import torch

        return torch.cuda.memory_allocated() / 2**20
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
