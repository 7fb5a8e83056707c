"""Hook `generate_stream_refusals` (patches/README.md #14): a streamed `/generate` request that
validation refuses gets its 4xx with the error object, not a 200 whose stream carries the error.

Why a hook: `/generate` validates inside the stream generator, after `StreamingResponse` has sent
200; the OpenAI routes already pull the first chunk first, `/generate` has no such step and no
registry to add one. The route is bound by FastAPI at import; `serve_generate_request` is what it
calls by name.
"""

from __future__ import annotations

import json

from ..compat import Hook


async def stream_refusals_hook(orig, obj, request):
    """AROUND `http_server.serve_generate_request(obj, request)`: for a streamed request, pull the
    stream's first chunk before the response starts. SGLang validates (and we refuse) inside that
    stream, so a refusal used to arrive as `data: {"error": ...}` after a 200; it is now answered
    with its own 4xx and the same error object. Otherwise the first chunk is put back in front of
    the stream: the client gets the same bytes, its headers when the first output is ready (as
    SGLang's OpenAI routes already do)."""
    response = await orig(obj, request)
    stream = getattr(response, "body_iterator", None)
    if not getattr(obj, "stream", False) or not hasattr(stream, "aclose"):
        return response
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:  # the client left before anything was produced
        first = None
    error = _sse_error(first)
    if error is not None:
        await stream.aclose()
        from starlette.responses import JSONResponse

        code = error.get("code")
        status = code if isinstance(code, int) and not isinstance(code, bool) and 400 <= code < 600 else 400
        # the stream's own clean-up (SGLang's abort of the request) still runs after the answer
        return JSONResponse({"error": error}, status_code=status, background=response.background)
    response.body_iterator = _prepended(first, stream)
    return response


def _sse_error(chunk) -> dict | None:
    """The error object of a `data: {"error": {...}}` event (SGLang's in-stream refusal), else None."""
    if not isinstance(chunk, (bytes, str)):
        return None
    raw = chunk.encode() if isinstance(chunk, str) else chunk
    if not raw.startswith(b'data: {"error"'):
        return None
    try:
        event = json.loads(raw[len(b"data: ") :])
    except ValueError:
        return None
    if isinstance(event, dict) and list(event) == ["error"] and isinstance(event["error"], dict):
        return event["error"]
    return None


async def _prepended(first, rest):
    if first is not None:
        yield first
    async for chunk in rest:
        yield chunk


HOOK = Hook(
    "generate_stream_refusals",
    "sglang.srt.entrypoints.http_server:serve_generate_request",
    ("obj", "request"),
    "AROUND",
    stream_refusals_hook,
)
