"""Hook `eagle_tree_page_check` (patches/README.md #5): SGLang's EAGLE argument step accepts
`--speculative-eagle-topk` > 1 with our backend's 128-token pages.

Why a hook: the step refuses topk > 1 with pages > 1 unless the backend is one of SGLang's cascade
backends (flashinfer, fa3, triton), which duplicate pages per branch. Our worker verifies a tree as
one deferred node-once segment per request over positional slots and needs no cascade; no registry
lets a backend declare that it supports paged trees.
"""

from __future__ import annotations

from ...names import BACKEND_NAME
from ..compat import Hook
from ..server_defaults import declared_during


def handle_eagle_family(orig, server_args):
    """SGLang refuses EAGLE topk > 1 with pages > 1 unless the backend is one of its cascade
    backends, which duplicate pages per branch. Our worker verifies trees node-once over
    positional slots and needs no cascade; the check is run with a backend it accepts and
    ours is declared back right after (the last declaration wins)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    if not (cfg.attention_backend == BACKEND_NAME and (cfg.speculative_eagle_topk or 1) > 1):
        return orig(server_args)
    with declared_during(
        server_args,
        "sglang_dsv4_ascend.tree_check",
        {"attention_backend": "triton"},
        {"attention_backend": BACKEND_NAME},
    ):
        return orig(server_args)


HOOK = Hook(
    "eagle_tree_page_check",
    "sglang.srt.arg_groups.speculative_hook:_handle_eagle_family",
    ("server_args",),
    "AROUND",
    handle_eagle_family,
)
