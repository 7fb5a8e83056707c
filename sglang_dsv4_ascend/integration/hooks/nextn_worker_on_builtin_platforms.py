"""Hook `nextn_worker_on_builtin_platforms` (patches/README.md #8): our speculative worker for
EAGLE / NEXTN / DSPARK on DeepSeek-V4 where SGLang's platform offers none.

Why a hook: `get_platform_worker_cls` consults the platform only when it is out of tree (our CPU
platform answers there); SGLang's builtin NPU platform would get SGLang's own EAGLE worker, which
cannot drive our model and backend. Unverified on NPU hardware.
"""

from __future__ import annotations

from ..compat import Hook


def platform_worker_cls(orig, self):
    """SGLang asks an out-of-tree platform for a worker (our CPU platform answers); SGLang's own
    NPU platform is not out of tree and is never asked, so EAGLE / NEXTN on DeepSeek-V4 would get
    SGLang's EAGLE worker, which cannot drive our model. Ours is returned where SGLang has none."""
    cls = orig(self)
    if cls is not None:
        return cls
    from ...speculative.worker import worker_cls_for  # imports SGLang's worker classes

    return worker_cls_for(self.name)


HOOK = Hook(
    "nextn_worker_on_builtin_platforms",
    "sglang.srt.speculative.spec_info:SpeculativeAlgorithm.get_platform_worker_cls",
    ("self",),
    "AROUND",
    platform_worker_cls,
)
