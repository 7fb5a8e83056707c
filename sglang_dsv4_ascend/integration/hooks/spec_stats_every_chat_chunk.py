"""Hook `spec_stats_every_chat_chunk` (patches/README.md #10; #11 is the same body on the
completions route): with `"return_spec_tokens_details": true`, every OpenAI chat stream chunk
that has choices carries `sglext.spec_tokens_details` (SGLang's own `SpecTokensDetails` builder,
its field names) and the request's `cached_tokens` so far, from the meta_info of the output the
chunk was made from (hook #12 puts the counters there for every output).

Nothing else changes: no chunk is added (a metadata-only chunk would read as a token to a client
timing TTFT / inter-token latency), the text and token fields are untouched, and requests
without the flag stream exactly as before.

Why a hook: upstream builds `sglext` for the final chunk only, and users need accept length and
per-position acceptance while a request streams.
"""

from __future__ import annotations

import json

from ..compat import Hook


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
    body = chunk[len("data: ") :]
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
    tail = body[len(body.rstrip("\n")) :]
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


HOOK = Hook(
    "spec_stats_every_chat_chunk",
    "sglang.srt.entrypoints.openai.serving_chat:OpenAIServingChat._generate_chat_stream",
    ("self", "adapted_request", "request", "raw_request"),
    "AROUND",
    stream_with_stats,
)
