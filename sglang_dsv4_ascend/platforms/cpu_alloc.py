"""Torch versions of the two token-slot helpers SGLang's speculative decode allocation
(`alloc_for_spec_decode`) launches as Triton kernels on any platform it does not recognise: on
CPU there is no Triton driver ("0 active drivers"), and the CPU kernel SGLang would use instead
comes from a CPU build of sgl-kernel that PyPI does not ship. Installed as AROUND hooks that act
only on CPU tensors (every other device keeps SGLang's kernels); see patches/README.md."""

from __future__ import annotations


def get_last_loc(orig, req_to_token, req_pool_indices_tensor, prefix_lens_tensor):
    """Slot of each request's last allocated token (-1 if none): SGLang's own torch version."""
    if req_to_token.device.type != "cpu":
        return orig(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)
    from sglang.srt.mem_cache.allocation import get_last_loc_torch

    return get_last_loc_torch(req_to_token, req_pool_indices_tensor, prefix_lens_tensor)


def assign_req_to_token_pool_func(orig, req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                                  batch_size):
    """req_to_token[r, start:end] = the next end - start slots of out_cache_loc, request by request."""
    if req_to_token.device.type != "cpu":
        return orig(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size)
    off = 0
    for r, s, e in zip(req_pool_indices.tolist()[:batch_size], start_offset.tolist(), end_offset.tolist()):
        req_to_token[r, s:e] = out_cache_loc[off: off + e - s].to(req_to_token.dtype)
        off += e - s


def prepare_mlp_sync_batch(orig, self, model_runner):
    """DP attention's per-forward padding and count exchange. SGLang pins a host tensor there
    unless its own CPU engine is on (`_is_cpu`, SGLANG_USE_CPU_ENGINE), and pinning needs CUDA: on
    a CPU batch the step runs with that module flag declared, as SGLang's CPU engine would (the
    only other use of the flag there picks the backend's CPU fill value for padded seq_lens)."""
    if self.input_ids.device.type != "cpu":
        return orig(self, model_runner)
    from sglang.srt.model_executor import forward_batch_info as fbi

    saved, fbi._is_cpu = fbi._is_cpu, True
    try:
        return orig(self, model_runner)
    finally:
        fbi._is_cpu = saved
