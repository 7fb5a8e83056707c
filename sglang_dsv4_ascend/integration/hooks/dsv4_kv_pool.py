"""Hook `dsv4_kv_pool` (patches/README.md #1): our DeepSeek-V4 KV pool where SGLang builds its own.

Why a hook: SGLang's DeepSeek-V4 branch rejects out-of-tree platforms and builds a pool whose
stores are CUDA kernels; the platform seam `get_kv_pool_cls(kind=...)` knows no `dsv4` kind.
Every other model goes to SGLang's own pool.
"""

from __future__ import annotations

import logging

from ..compat import Hook

logger = logging.getLogger("sglang_dsv4_ascend")


def build_token_to_kv_pool(orig, self, *, sizes, is_dsa_model, is_dsv4_model, req_to_token_pool):
    """Build our DSV4 pool where SGLang would build (and, for an OOT platform, reject) its own.
    Its compressed entries are paged through `req_to_token`, one entry row per r token slots."""
    if not is_dsv4_model:
        return orig(
            self,
            sizes=sizes,
            is_dsa_model=is_dsa_model,
            is_dsv4_model=is_dsv4_model,
            req_to_token_pool=req_to_token_pool,
        )
    from sglang.srt.runtime_context import get_memory, get_schedule

    from ...attention_backend.pool import DSV4TokenToKVPool
    from ...config import DSV4Config

    cfg = DSV4Config.from_hf(self.model_config.hf_config)
    dtype = self.model_config.dtype
    if self.kv_cache_dtype != dtype:
        logger.info(
            "dsv4_ascend: caches are kept in the model dtype %s (kv_cache_dtype %s is not supported yet)",
            dtype,
            self.kv_cache_dtype,
        )
    return DSV4TokenToKVPool(
        size=sizes.max_total_num_tokens,
        page_size=get_schedule().page_size,
        dtype=dtype,
        cfg=cfg,
        req_to_token=req_to_token_pool.req_to_token,
        spec_slack=spec_slack(),
        device=self.device,
        prefix_states=not get_memory().disable_radix_cache,
    )


def spec_slack() -> int:
    """Positions a verify reads past the committed length: the tree's depth + 1 <= draft tokens.
    Verify writes are deferred and only accepted rows are stored, so the rings need no extra rows
    for rejected ones; the slack is what lets a verify at the end of the context stay in range."""
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    if not spec.speculative_algorithm:
        return 0
    return int(max(spec.speculative_num_draft_tokens or 0, (spec.speculative_num_steps or 0) + 1))


HOOK = Hook(
    "dsv4_kv_pool",
    "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._build_token_to_kv_pool",
    ("self", "sizes", "is_dsa_model", "is_dsv4_model", "req_to_token_pool"),
    "AROUND",
    build_token_to_kv_pool,
)
