"""Hook `cpu_spec_last_loc` (patches/README.md #6): on CPU tensors, SGLang's own torch formula
for each request's last allocated token slot; every other device keeps SGLang's kernel.

Why a hook: speculative decode allocation (`alloc_for_spec_decode`) picks the Triton kernel for
every attention backend not named `ascend` or `torch_native`; on CPU there is no Triton driver
("0 active drivers") and the request dies.
"""

from __future__ import annotations

from ..compat import Hook


def get_last_loc(orig, req_to_token, req_pool_indices_tensor, prefix_lens_tensor):
    """Slot of each request's last allocated token (-1 if none): SGLang's own torch version."""
    if req_to_token.device.type != "cpu":
        return orig(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    return get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)


HOOK = Hook(
    "cpu_spec_last_loc",
    "sglang.srt.mem_cache.allocation:get_last_loc",
    ("req_to_token", "req_pool_indices_tensor", "prefix_lens_tensor"),
    "AROUND",
    get_last_loc,
)
