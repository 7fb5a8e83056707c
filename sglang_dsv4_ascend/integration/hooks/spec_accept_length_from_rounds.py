"""Hook `spec_accept_length_from_rounds` (patches/README.md #15): a request's `spec_accept_length`
counts only the tokens its verify rounds committed, and a request without a verify round still
carries the counters, at zero.

Why a hook: SGLang divides all completion tokens by the rounds, so with `--enable-mixed-chunk`
the tokens a running request decodes as plain one-token steps riding a prefill chunk (and the
prefill's first token) counted as accepted drafts (8.7-9.8 per round for block size 4, whose
maximum is 5). `_calculate_spec_decoding_metrics` is the one place both the per-output path (hook
spec_stats_every_output) and SGLang's finished-request path compute the counters.
"""

from __future__ import annotations

from ..compat import Hook


def _at(recv_obj, name, i):
    values = getattr(recv_obj, name, None)
    return values[i] if values is not None and len(values) > i else None


def verify_round_metrics(orig, self, meta_info, recv_obj, i):
    """AROUND SGLang's `_calculate_spec_decoding_metrics`: `spec_accept_length` counts the tokens
    verify rounds committed, per round (1 + correct drafts / rounds, bonus included), so it never
    exceeds `speculative_num_draft_tokens`. SGLang divides all completion tokens by the rounds,
    which counts the prefill's token and every token a request decoded as a plain one-token step
    riding a mixed chunk (`--enable-mixed-chunk`): 8.7-9.8 for block size 4 was reported. A request
    that had no verify round (one output token, or every step mixed) still carries the counters,
    at zero, where SGLang left them out."""
    orig(self, meta_info, recv_obj, i)
    rounds = _at(recv_obj, "spec_verify_ct", i)
    if rounds is None:
        return None
    correct = _at(recv_obj, "spec_num_correct_drafts", i) or 0
    if rounds > 0:
        meta_info["spec_accept_length"] = 1 + correct / rounds
    else:
        meta_info.update(
            spec_verify_ct=0,
            spec_num_correct_drafts=0,
            spec_num_proposed_drafts=0,
            spec_accept_rate=0.0,
            spec_accept_length=0.0,
        )
    return None


HOOK = Hook(
    "spec_accept_length_from_rounds",
    "sglang.srt.managers.tokenizer_manager:TokenizerManager._calculate_spec_decoding_metrics",
    ("self", "meta_info", "recv_obj", "i"),
    "AROUND",
    verify_round_metrics,
)
