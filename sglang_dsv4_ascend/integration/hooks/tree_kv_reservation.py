"""Hook `tree_kv_reservation` (patches/README.md #23): the KV a NextN tree round reserves per
request is what our worker writes, not a page per branch.

Why a hook: for a tree (topk > 1) with pages > 1, SGLang's decode reservation assumes a cascade
backend that duplicates pages per branch: ceil((2 (page - 1) + steps) / page) pages for each of
topk branches, doubled for overlap (2048 token slots a request per round at topk 4 with our
128-token pages). Our worker verifies the tree node-once against per-slot rings and commits only
the accepted path, at most steps + 1 positions past the committed length, so a round needs what
a chain of the same draft tokens needs. The function is module state that the decode preparation
and the pool sizing call; no registry lets a worker say what a round writes.
"""

from __future__ import annotations

from ..compat import Hook


def alloc_len_per_decode(orig):
    """SGLang's sizing, except for a tree served by our worker: max(steps * topk, draft tokens)
    (SGLang's own figure for pages of one token, which covers the accepted path's steps + 1)."""
    from sglang.srt.runtime_context import get_spec

    from ... import checkpoint
    from ...names import NEXTN_ALGOS

    spec = get_spec()
    topk = spec.speculative_eagle_topk or 1
    algo = str(spec.speculative_algorithm or "").upper()
    if topk <= 1 or algo not in NEXTN_ALGOS or not checkpoint.serves_dsv4():
        return orig()
    return max((spec.speculative_num_steps or 1) * topk, spec.speculative_num_draft_tokens or 0)


HOOK = Hook(
    "tree_kv_reservation",
    "sglang.srt.mem_cache.allocation_sizing:get_alloc_len_per_decode",
    (),
    "AROUND",
    alloc_len_per_decode,
)
