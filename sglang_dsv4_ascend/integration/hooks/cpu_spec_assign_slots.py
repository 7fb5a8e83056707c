"""Hook `cpu_spec_assign_slots` (patches/README.md #7): on CPU tensors, SGLang's token-slot
writer of speculative decode allocation in torch; every other device keeps SGLang's kernel.

Why a hook: `assign_req_to_token_pool_func` launches a Triton kernel (no driver on CPU: "0 active
drivers") unless SGLANG_USE_CPU_ENGINE=1, and then calls a CPU build of sgl-kernel that PyPI does
not ship. Only speculative decode allocation (`alloc_for_spec_decode`) reaches it here.
"""

from __future__ import annotations

from ..compat import Hook


def assign_req_to_token_pool_func(
    orig, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size
):
    """req_to_token[r, start:end] = the next end - start slots of out_cache_loc, request by request."""
    if req_to_token.device.type != "cpu":
        return orig(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size)
    off = 0
    for r, s, e in zip(req_pool_indices.tolist()[:batch_size], start_offset.tolist(), end_offset.tolist()):
        req_to_token[r, s:e] = out_cache_loc[off : off + e - s].to(req_to_token.dtype)
        off += e - s


HOOK = Hook(
    "cpu_spec_assign_slots",
    "sglang.srt.mem_cache.allocation:assign_req_to_token_pool_func",
    ("req_pool_indices", "req_to_token", "start_offset", "end_offset", "out_cache_loc", "batch_size"),
    "AROUND",
    assign_req_to_token_pool_func,
)
