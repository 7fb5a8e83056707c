"""Hook `request_normalize_errors` (patches/README.md #3): errors in SGLang's reshaping of a
request's fields become 400s naming the cause; `n` is checked before it multiplies the request.

Why a hook: `normalize_batch_and_arguments` only reads what the client sent, so every error in
it is the client's, but SGLang maps only ValueError to 400 (`sampling_params: []` was a 500,
`n: 0` reached a range() step).
"""

from __future__ import annotations

from ...checkpoint import serves_dsv4
from ..compat import Hook
from ..request_guard import INPUT_EMBEDS_REFUSED, RequestRejected, check_n

_CLIENT_FAULTS = (TypeError, IndexError, KeyError, AttributeError, OverflowError)


def normalize_hook(orig, self):
    """AROUND hook on `GenerateReqInput.normalize_batch_and_arguments(self)`: that step only
    reshapes what the client sent, so any error in it is the client's. Stock SGLang lets some
    escape as TypeError / IndexError / OverflowError (e.g. `n: null`, `sampling_params: []`,
    `n: 2**63`), which become 500s; they become 400s here. `n` is checked first, before it
    multiplies the request (and `n: 0` reaches a range() step). input_embeds for DeepSeek-V4 is
    refused here, first: SGLang's own refusal under the radix cache would send the user to
    --disable-radix-cache, after which ours would refuse it anyway."""
    if getattr(self, "input_embeds", None) is not None and serves_dsv4():
        raise RequestRejected(INPUT_EMBEDS_REFUSED)
    params = getattr(self, "sampling_params", None)
    for p in params if isinstance(params, list) else [params]:
        if isinstance(p, dict):
            check_n(p)
    try:
        return orig(self)
    except _CLIENT_FAULTS as e:
        raise RequestRejected(
            f"malformed request (text / input_ids / sampling_params do not fit together "
            f"or have the wrong type): {type(e).__name__}: {e}"
        ) from e


HOOK = Hook(
    "request_normalize_errors",
    "sglang.srt.managers.io_struct:GenerateReqInput.normalize_batch_and_arguments",
    ("self",),
    "AROUND",
    normalize_hook,
)
