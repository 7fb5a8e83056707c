"""Hook `cpu_compile_fake_ops` (patches/README.md #16): SGLang's CPU graph runner starts without
sgl-kernel's CPU build.

Why a hook: under `--enable-torch-compile` the runner first registers shape functions for
sgl-kernel's CPU operators (`register_fake_ops`), and registering one for an operator that does
not exist raises: PyPI has no CPU build of sgl-kernel, so the runner died before capturing
anything. The function is module state the runner's constructor calls; no registry covers it.
"""

from __future__ import annotations

from ..compat import Hook


def register_fake_ops(orig, tp_size):
    """SGLang's registration when sgl-kernel's CPU operators exist; nothing otherwise (no model
    can call an operator that does not exist, so there is no shape to describe)."""
    import torch

    if not hasattr(torch.ops.sgl_kernel, "shm_allreduce"):
        return None
    return orig(tp_size)


HOOK = Hook(
    "cpu_compile_fake_ops",
    "sglang.srt.model_executor.cpu_graph_runner:register_fake_ops",
    ("tp_size",),
    "AROUND",
    register_fake_ops,
)
