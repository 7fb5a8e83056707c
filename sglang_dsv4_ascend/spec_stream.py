"""Speculative statistics in every stream chunk (hooks #10-#12 and #15 in patches/README.md).

SGLang computes a request's speculative counters (`spec_verify_ct`, `spec_accept_length`, the
histograms, ...) into meta_info only when the request finishes, and its OpenAI streams put
`sglext.spec_tokens_details` into the final chunk only. `every_output_metrics` computes the same
counters (SGLang's own `_calculate_spec_decoding_metrics`) for every output, so every native
stream chunk carries them (with `verify_round_metrics`' accept length: verify-round tokens only); with `"return_spec_tokens_details": true`, `stream_with_stats` adds the
same `SpecTokensDetails`
(SGLang's own builder, its field names) and the request's `cached_tokens` so far to every chunk
that has choices, from the meta_info of the output that chunk was made from.

Nothing else changes: no chunk is added (a metadata-only chunk would read as a token to a client
timing TTFT / inter-token latency), the text and token fields are untouched, and requests
without the flag stream exactly as before.
"""

from __future__ import annotations

import json


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
        meta_info.update(spec_verify_ct=0, spec_num_correct_drafts=0, spec_num_proposed_drafts=0,
                         spec_accept_rate=0.0, spec_accept_length=0.0)
    return None


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
    # through the class, it is the hooked one (verify_round_metrics), as for a finished request.
    TokenizerManager._calculate_spec_decoding_metrics(None, meta_info, recv_obj, i)
    return None


class _Outputs:
    """A tokenizer_manager stand-in that remembers the latest meta_info per choice index."""

    def __init__(self, real, latest: dict):
        self._real, self._latest = real, latest

    def __getattr__(self, name):
        return getattr(self._real, name)

    def generate_request(self, *args, **kwargs):
        stream, latest = self._real.generate_request(*args, **kwargs), self._latest

        async def recorded():
            async for content in stream:
                latest[content.get("index", 0)] = content.get("meta_info") or {}
                yield content

        return recorded()


class _Serving:
    """The serving object as the stream method sees it, with the recording tokenizer_manager."""

    def __init__(self, real, latest: dict):
        self._real = real
        self.tokenizer_manager = _Outputs(real.tokenizer_manager, latest)

    def __getattr__(self, name):
        return getattr(self._real, name)


def _with_stats(chunk, latest: dict):
    if not isinstance(chunk, str) or not chunk.startswith("data: ") or chunk.startswith("data: [DONE]"):
        return chunk
    body = chunk[len("data: "):]
    try:
        obj = json.loads(body)
    except ValueError:
        return chunk
    choices = obj.get("choices") or []
    if not choices:
        return chunk
    from sglang.srt.entrypoints.openai.utils import spec_tokens_details_from_meta_info

    details = []
    for c in choices:
        meta = latest.get(c.get("index", 0))
        d = spec_tokens_details_from_meta_info(meta) if meta else None
        if d is not None:
            details.append(d.model_dump())
    if not details:
        return chunk
    ext = obj.get("sglext") or {}
    if ext.get("spec_tokens_details") is None:
        ext["spec_tokens_details"] = details[0] if len(details) == 1 else details
    meta = latest.get(choices[0].get("index", 0)) or {}
    if "cached_tokens" in meta:
        ext.setdefault("cached_tokens", meta["cached_tokens"])
    obj["sglext"] = ext
    tail = body[len(body.rstrip("\n")):]
    return "data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + tail


async def stream_with_stats(orig, self, adapted_request, request, raw_request):
    """AROUND the OpenAI chat / completion stream generators."""
    if not getattr(request, "return_spec_tokens_details", False):
        async for chunk in orig(self, adapted_request, request, raw_request):
            yield chunk
        return
    latest = {}
    async for chunk in orig(_Serving(self, latest), adapted_request, request, raw_request):
        yield _with_stats(chunk, latest)
