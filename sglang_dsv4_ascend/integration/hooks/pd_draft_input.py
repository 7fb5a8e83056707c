"""Hook `pd_draft_input` (patches/README.md #20): the first draft input of a request that arrives
by PD transfer, for our speculative worker.

Why a hook: when a transferred request joins the decode batch, SGLang builds its speculative
input in `SpeculativeAlgorithm.build_disagg_draft_input`, per builtin algorithm (EAGLE reads
hidden states from the transfer's metadata, DSPARK builds its own input class); there is no
per-worker seam. Our worker's draft state is already in the transferred request rows, so its
input is only the token the prefill side sampled, as after a local prefill.
"""

from __future__ import annotations

from ..compat import Hook


def dsv4_draft_input(orig, self, batch, last_tokens_tensor, future_map):
    from ...speculative.worker import DSV4DraftInput, worker_cls_for

    if worker_cls_for(self.name) is None:
        return orig(self, batch, last_tokens_tensor, future_map)
    import torch

    return DSV4DraftInput(last_tokens_tensor.to(torch.int64))


HOOK = Hook(
    "pd_draft_input",
    "sglang.srt.speculative.spec_info:SpeculativeAlgorithm.build_disagg_draft_input",
    ("self", "batch", "last_tokens_tensor", "future_map"),
    "AROUND",
    dsv4_draft_input,
)
