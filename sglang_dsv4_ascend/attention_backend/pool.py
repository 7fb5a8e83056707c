"""The DeepSeek-V4 KV pool as SGLang sees it: a `KVCache` whose storage is a `DSV4Cache`.

SGLang's allocator still hands out one token slot per token (the request's row in `req_to_token`).
The compressed C4 / C128 / indexer entries are paged through those token slots (entry j of a
request at `req_to_token[req, j*r] // r`), so they are allocated and freed with the request's
pages; the fixed-size per-request state (SWA ring, compressor rows) lives per request slot
(req_pool_idx). No per-token K/V buffer exists, so the MHA-style accessors refuse loudly instead of
returning something that would be silently wrong.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
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

    # -- PD disaggregation: what SGLang's transfer layer registers and sends ---------------------
    head_num = 1  # DeepSeek-V4 attention is MQA: one KV head, whole on every rank

    def get_contiguous_buf_infos(self):
        """The paged stores, as SGLang's PD path registers a pool's KV: one buffer per compressed
        entry store (C4 KV, C4 indexer keys, C128 KV per layer), one item per token-slot page. Entry
        rows of page p are [p * page / r, (p + 1) * page / r) (rows are keyed by token slot // r),
        so the transfer's page indices address them as they address other models' K/V pages."""
        stores = self.cache.page_stores(self.page_size)
        ptrs = [e.data_ptr() for e, _ in stores]
        lens = [e.numel() * e.element_size() for e, _ in stores]
        return ptrs, lens, [item for _, item in stores]

    def request_row_tensors(self) -> list:
        """The per-request state SGLang's PD path sends slot to slot (`StateType.REQUEST_ROW`, hook
        pd_request_state): every layer's SWA ring and open compressor rows."""
        return self.cache.slot_tensors()

    def pd_layout(self, draft_tensors: list = ()) -> str:
        """What both PD sides must share for a transfer to be exact, in the form SGLang compares
        at bootstrap (`kv_args.kv_layout`, refused on a mismatch with both strings): the model's
        config, the page, the dtype, and the bytes each paged store holds per page and each
        per-slot tensor per slot (the speculative draft's separately)."""
        conf = json.dumps(dataclasses.asdict(self.cfg), sort_keys=True, default=str)
        _, _, page_bytes = self.get_contiguous_buf_infos()
        rows = request_row_buf_infos(self.request_row_tensors())[2]
        draft = request_row_buf_infos(list(draft_tensors))[2]
        return (
            f"dsv4_ascend(config {hashlib.sha256(conf.encode()).hexdigest()[:12]}, page {self.page_size}, "
            f"{str(self.dtype).removeprefix('torch.')}, paged {len(page_bytes)} stores {sum(page_bytes)} B/page, "
            f"request rows {len(rows)} tensors {sum(rows)} B/slot, draft rows {len(draft)} tensors {sum(draft)} B/slot)"
        )

    def get_kv_size_bytes(self):
        return self.cache.nbytes()["total"] + (self.cache.prefix.nbytes() if self.cache.prefix else 0)

    def _no_token_buffers(self, *a, **k):
        raise NotImplementedError(
            "DSV4TokenToKVPool keeps DeepSeek-V4 state per request slot (SWA ring, compressor rows, "
            "C4/C128 entries); it has no per-token K/V buffers. Only the dsv4_ascend attention "
            "backend and the sglang_dsv4_ascend DeepSeek-V4 model may use it."
        )

    get_key_buffer = get_value_buffer = get_kv_buffer = set_kv_buffer = _no_token_buffers


def request_row_buf_infos(tensors: list):
    """(pointers, byte lengths, bytes per request slot) of per-slot tensors [slots, ...], as
    SGLang's `append_state_component` takes them."""
    ptrs, lens, items = [], [], []
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"dsv4_ascend PD: a per-slot state tensor {tuple(t.shape)} is not contiguous")
        ptrs.append(t.data_ptr())
        lens.append(t.numel() * t.element_size())
        items.append(t[0].numel() * t.element_size())
    return ptrs, lens, items
