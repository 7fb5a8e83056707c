"""Hook `spec_stats_every_output` (patches/README.md #12): SGLang's speculative counters
(`spec_verify_ct`, `spec_accept_length`, the histograms, ...) in every output of a request, not
only the finished one, so every native stream chunk carries them.

Why a hook: the tokenizer manager computes the counters only for finished requests;
`try_build_beam_search_out_dict` is the function it calls for every output once meta_info is
complete. The counters are SGLang's own (`_calculate_spec_decoding_metrics`, which reads only its
arguments, and hook spec_accept_length_from_rounds counts only verify-round tokens in its accept
length), computed the same way a finished request's are.
"""

from __future__ import annotations

from ..compat import Hook


def every_output_metrics(recv_obj, i, meta_info):
    """BEFORE SGLang's per-output hand-off (`try_build_beam_search_out_dict`, called once meta_info
    is complete): the speculative counters so far, for unfinished requests too."""
    if "spec_verify_ct" in meta_info:
        return None
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.runtime_context import get_spec

    try:
        if not get_spec().speculative_algorithm:
            return None
    except ValueError:
        return None
    # the method reads only its arguments (and the spec config); it has no instance state. Called
    # through the class, it is the hooked one (spec_accept_length_from_rounds), as for a finished request.
    TokenizerManager._calculate_spec_decoding_metrics(None, meta_info, recv_obj, i)
    return None


HOOK = Hook(
    "spec_stats_every_output",
    "sglang.srt.beam_search.output:try_build_beam_search_out_dict",
    ("recv_obj", "i", "meta_info"),
    "BEFORE",
    every_output_metrics,
)
