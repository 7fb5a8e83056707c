"""Hook `pd_request_state` (patches/README.md #17): our per-request state in SGLang's PD transfer.

Why a hook: SGLang's PD path describes a pool's state in `setup_state_kv_args` by a chain of
isinstance checks over its own pool classes; an out-of-tree pool has no way in. Ours keeps each
request's SWA ring and open compressor rows (and the speculative draft's) per request slot, which
is exactly SGLang's `StateType.REQUEST_ROW`: one item per req_pool_idx, sent slot to slot by every
transfer backend. The paged entries need no hook (`DSV4TokenToKVPool.get_contiguous_buf_infos`).
It also sets the layout string both sides compare at bootstrap (`DSV4TokenToKVPool.pd_layout`), so
peers with different checkpoints, pages, speculative rows or drafts are refused before any byte
moves.
"""

from __future__ import annotations

import logging

from ..compat import Hook

logger = logging.getLogger("sglang_dsv4_ascend")


def add_request_rows(orig, kv_args, token_to_kv_pool, *args, **kwargs):
    orig(kv_args, token_to_kv_pool, *args, **kwargs)
    from ...attention_backend.pool import DSV4TokenToKVPool, request_row_buf_infos

    if not isinstance(token_to_kv_pool, DSV4TokenToKVPool):
        return
    from sglang.srt.disaggregation.base.conn import StateType
    from sglang.srt.disaggregation.utils import append_state_component

    draft = args[0] if args else kwargs.get("draft_token_to_kv_pool")
    # our speculative worker's draft state (speculative/worker.DraftState)
    draft_tensors = draft.request_row_tensors() if draft is not None else []
    tensors = token_to_kv_pool.request_row_tensors() + draft_tensors
    append_state_component(kv_args, StateType.REQUEST_ROW, *request_row_buf_infos(tensors))
    # SGLang's bootstrap refuses a peer whose layout string differs (common/conn.py), naming both
    kv_args.kv_layout = token_to_kv_pool.pd_layout(draft_tensors)
    logger.info("dsv4_ascend PD layout: %s", kv_args.kv_layout)


HOOK = Hook(
    "pd_request_state",
    "sglang.srt.disaggregation.utils:setup_state_kv_args",
    ("kv_args", "token_to_kv_pool", "draft_token_to_kv_pool", "total_kv_layers", "req_to_token_pool"),
    "AROUND",
    add_request_rows,
)
