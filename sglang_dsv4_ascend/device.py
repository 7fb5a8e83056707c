"""The one place that decides which device family is active and which kernel family runs.

Model and layer code never asks "is this an NPU?"; it calls ops through `sglang_dsv4_ascend.ops`,
which dispatch on `kernel_family()` decided here, once per process.

    SGLANG_DSV4_FORCE_REFERENCE=1   run the plain-torch reference ops everywhere (bisecting numerics)
"""

from __future__ import annotations

import functools
import importlib.util

from . import settings


@functools.lru_cache(maxsize=None)
def device_family() -> str:
    """'npu', 'cuda' or 'cpu'. Probes torch_npu by spec only: importing it without CANN breaks."""
    if importlib.util.find_spec("torch_npu") is not None:
        return "npu"
    import torch

    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


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
