"""The radix (prefix) cache for DeepSeek-V4: SGLang's RadixCache, with hits cut to a boundary
the model can resume from.

SGLang's tree already shares what DeepSeek-V4 keeps per token: the compressed C4 / C128 /
indexer entries are paged through the tree's token slots (`kvcache/cache.py`). What a token slot does not
carry is the request's window and open compressor rows at the hit's end; those come from the
prefix state saved at that page boundary (`kvcache/prefix_state.py`). So a match is reported only up to
the deepest page boundary that has a state: everything past it is recomputed, never read from
another request's history. The tree itself, its locking and eviction are SGLang's, unchanged.

Registered as `--radix-cache-backend dsv4_ascend`, which the plugin declares for DeepSeek-V4
when the radix cache is on (`integration/server_defaults.model_adjustments`).
"""

from __future__ import annotations

import logging

from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams, MatchResult
from sglang.srt.mem_cache.radix_cache import RadixCache

logger = logging.getLogger(__name__)


class DSV4RadixCache(RadixCache):
    def __init__(self, params):
        super().__init__(params)
        self._inserting = False

    @property
    def states(self):
        """The pool's prefix state store (built with the pool, after this tree on some paths)."""
        return self.token_to_kv_pool_allocator.get_kvcache().cache.prefix

    def match_prefix(self, params: MatchPrefixParams) -> MatchResult:
        result = super().match_prefix(params)
        if self._inserting or result.device_prefix_len == 0:
            # checkpoint() re-matches what the request itself just inserted: its own slot holds
            # that state already, nothing is resumed from elsewhere.
            return result
        length = result.device_prefix_len
        slots = self.path_device_indices(result.last_device_node)[:length].tolist()
        states = self.states
        usable = states.usable_prefix(slots, length)
        if usable == length:
            return result
        if params.req is not None:  # the tree branches at `length`: save a state there this time
            states.hint(params.req.rid, length)
        if usable == 0:
            return self._empty_match_result
        # Matching the shorter key ends the match (splitting a node if needed) exactly there.
        return super().match_prefix(
            MatchPrefixParams(key=params.key[:usable], cow_mamba=params.cow_mamba, req=params.req)
        )

    def checkpoint(self, req, *, up_to: int, **kwargs):
        """SGLang's insert; where the tree already held some of the request's pages, it frees the
        request's copies and points its row at the tree's slots. States the request saved under
        its own slots then move to the tree's (same tokens, same state), unless the tree's slot
        already has one."""
        page = self.page_size
        row = self.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
        ends = slice(page - 1, up_to - up_to % page, page)  # position b - 1 of each boundary b
        before = row[ends].tolist()
        self._inserting = True
        try:
            return super().checkpoint(req, up_to=up_to, **kwargs)
        finally:
            self._inserting = False
            after = row[ends].tolist()
            states = self.states
            for k, (old, new) in enumerate(zip(before, after)):
                if old != new:
                    states.rekey(old, new, (k + 1) * page)


def create_dsv4_radix_cache(ctx):
    """`register_radix_cache_backend` factory (SGLang's TreeCacheBuildContext in, a tree out)."""
    return DSV4RadixCache(ctx.params)
