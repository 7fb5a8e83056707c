"""The DeepSeek-V4 KV pool as SGLang sees it: a `KVCache` whose storage is a `DSV4Cache`.

SGLang's allocator still hands out one token slot per token (the request's row in `req_to_token`).
The compressed C4 / C128 / indexer entries are paged through those token slots (entry j of a
request at `req_to_token[req, j*r] // r`), so they are allocated and freed with the request's
pages; the fixed-size per-request state (SWA ring, compressor rows) lives per request slot
(req_pool_idx). No per-token K/V buffer exists, so the MHA-style accessors refuse loudly instead of
returning something that would be silently wrong.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from .. import settings
from ..kvcache.cache import ENTRY_ALIGN, DSV4Cache

logger = logging.getLogger(__name__)


class DSV4TokenToKVPool(KVCache):
    def __init__(
        self,
        *,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        cfg,
        req_to_token: torch.Tensor,
        spec_slack: int,
        device: str,
        enable_memory_saver: bool = False,
        prefix_states: bool = False,
    ):
        super().__init__(
            size=size,
            page_size=page_size,
            dtype=dtype,
            layer_num=cfg.num_hidden_layers,
            device=device,
            enable_memory_saver=enable_memory_saver,
            allocation_label="DeepSeek-V4 (dsv4_ascend)",
        )
        ratios = {r for r in cfg.compress_ratios if r}
        if any(page_size % r for r in ratios):
            raise ValueError(
                f"dsv4_ascend: --page-size {page_size} must be a multiple of every compression "
                f"ratio {sorted(ratios)} ({ENTRY_ALIGN} serves all): compressed entries are "
                "addressed by the token slot of their block's first token"
            )
        self.cfg = cfg
        num_slots, max_context_len = req_to_token.shape
        # Token-slot ids run up to size + page_size (SGLang's pools keep one padding page).
        self.cache = DSV4Cache(
            cfg,
            num_slots,
            max_context_len - spec_slack,
            spec_slack,
            dtype=dtype,
            device=device,
            token_slots=req_to_token,
            num_token_slots=size + page_size,
        )
        if prefix_states:  # the radix cache is on: save states at page boundaries (kvcache/prefix_state.py)
            st = self.cache.enable_prefix_states(page=page_size).stats()
            logger.info(
                "dsv4_ascend prefix states: %d x %.2f MiB = %.1f MiB (set %s to change the count)",
                st["capacity"],
                st["bytes"] / st["capacity"] / 2**20,
                st["bytes"] / 2**20,
                settings.PREFIX_STATES.name,
            )
        nb = self.cache.nbytes()
        logger.info(
            "dsv4_ascend cache: %d request slots x %d tokens (+%d speculative rows), %s",
            num_slots,
            max_context_len,
            spec_slack,
            ", ".join(f"{k}={v / 2**20:.1f} MiB" for k, v in nb.items()),
        )
        self._finalize_allocation_log(size)

    def get_kv_size_bytes(self):
        return self.cache.nbytes()["total"] + (self.cache.prefix.nbytes() if self.cache.prefix else 0)

    def _no_token_buffers(self, *a, **k):
        raise NotImplementedError(
            "DSV4TokenToKVPool keeps DeepSeek-V4 state per request slot (SWA ring, compressor rows, "
            "C4/C128 entries); it has no per-token K/V buffers. Only the dsv4_ascend attention "
            "backend and the sglang_dsv4_ascend DeepSeek-V4 model may use it."
        )

    get_key_buffer = get_value_buffer = get_kv_buffer = set_kv_buffer = _no_token_buffers
