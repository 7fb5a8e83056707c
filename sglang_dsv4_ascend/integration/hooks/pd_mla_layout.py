"""Hook `pd_mla_layout` (patches/README.md #19): our pool's transfer layout is MLA's.

Why a hook: SGLang's PD path picks the byte layout of a pool's buffers with `is_mla_backend`, an
isinstance check over its own pool classes. Anything else is taken as MHA: the buffer list split
in a K half and a V half that share item lengths and heads sliced across TP. Ours is MLA's
layout: one buffer per store with its own item length, and the whole (single-head) KV on every
attention rank, so a decode rank can take it from any prefill rank.
"""

from __future__ import annotations

from ..compat import Hook


def mla_layout(orig, target_kv_pool):
    from ...attention_backend.pool import DSV4TokenToKVPool

    return isinstance(target_kv_pool, DSV4TokenToKVPool) or orig(target_kv_pool)


HOOK = Hook(
    "pd_mla_layout",
    "sglang.srt.disaggregation.utils:is_mla_backend",
    ("target_kv_pool",),
    "AROUND",
    mla_layout,
)
