"""Hook `request_validation` (patches/README.md #2): every tokenized request checked before it
reaches the scheduler (`request_guard.check_request`), refused with a 400 naming the field.

Why a hook: stock SGLang lets through requests that crash the scheduler (an out-of-vocabulary id,
a `top_logprobs_num` above the vocabulary, a `top_k` past int32, ...) or that it never admits (a
prompt past the pool), and has no request-validation registry. `_validate_one_request` is the one
per-request step that single, batched, completion and chat requests all pass through.
"""

from __future__ import annotations

from ...checkpoint import is_dsv4_architectures
from ..compat import Hook
from ..request_guard import check_request, pool_limits


def validate_one_request_hook(self, obj, input_ids):
    """BEFORE hook on `TokenizerManager._validate_one_request(self, obj, input_ids)`."""
    hf = self.model_config.hf_config
    check_request(
        obj,
        input_ids,
        vocab_size=self.model_config.vocab_size,
        dsv4=is_dsv4_architectures(getattr(hf, "architectures", None)),
        speculative=getattr(self.server_args, "speculative_algorithm", None),
        context_len=getattr(self, "context_len", None),
        limits=pool_limits(self),
        checks_total=getattr(self, "validate_total_tokens", True),
        truncates=bool(getattr(self, "allow_auto_truncate", False)),
    )
    return None


HOOK = Hook(
    "request_validation",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request",
    ("self", "obj", "input_ids"),
    "BEFORE",
    validate_one_request_hook,
)
