"""The DeepSeek-V4 KV pool as SGLang sees it: a `KVCache` whose storage is a `DSV4Cache`.

SGLang's allocator still hands out one token slot per token (the request's row in `req_to_token`);
what those tokens leave behind lives here, per request slot (req_pool_idx): SWA rings, compressor
rows and compressed C4 / C128 / indexer entries. No per-token K/V buffer exists, so the MHA-style
accessors refuse loudly instead of returning something that would be silently wrong.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.mem_cache.memory_pool import KVCache

from ..attention_backend.cache import DSV4Cache

logger = logging.getLogger(__name__)


class DSV4TokenToKVPool(KVCache):
    def __init__(self, *, size: int, page_size: int, dtype: torch.dtype, cfg, num_slots: int,
                 max_context_len: int, spec_slack: int, device: str, enable_memory_saver: bool = False):
        super().__init__(size=size, page_size=page_size, dtype=dtype, layer_num=cfg.num_hidden_layers,
                         device=device, enable_memory_saver=enable_memory_saver,
                         allocation_label="DeepSeek-V4 (dsv4_ascend)")
        self.cfg = cfg
        self.cache = DSV4Cache(cfg, num_slots, max_context_len, spec_slack, dtype=dtype, device=device)
        nb = self.cache.nbytes()
        logger.info("dsv4_ascend cache: %d request slots x %d tokens (+%d speculative rows), %s",
                    num_slots, max_context_len, spec_slack,
                    ", ".join(f"{k}={v / 2**20:.1f} MiB" for k, v in nb.items()))
        self._finalize_allocation_log(size)

    def get_kv_size_bytes(self):
        return self.cache.nbytes()["total"]

    def _no_token_buffers(self, *a, **k):
        raise NotImplementedError(
            "DSV4TokenToKVPool keeps DeepSeek-V4 state per request slot (SWA ring, compressor rows, "
            "C4/C128 entries); it has no per-token K/V buffers. Only the dsv4_ascend attention "
            "backend and the sglang_dsv4_ascend DeepSeek-V4 model may use it."
        )

    get_key_buffer = get_value_buffer = get_kv_buffer = set_kv_buffer = _no_token_buffers
