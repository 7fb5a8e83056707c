"""Hook `http_request_gate` (patches/README.md #4): `request_guard.RequestGate`, an ASGI
middleware, added to SGLang's FastAPI app just before it serves: oversized bodies get 413 before
they are parsed or tokenized, bodies of a shape SGLang's parsing answers with a 500 get 400.

Why a hook: the app exists at import, but only the HTTP launch path knows it is about to serve;
adding middleware from `register()` would import the HTTP server in every process, and Starlette
refuses middleware after start.
"""

from __future__ import annotations

from ..compat import Hook
from ..request_guard import RequestGate


def add_request_gate(server_args, *args, **kwargs):
    """BEFORE hook on `http_server.launch_server`: add the middleware to SGLang's app before it
    starts serving (Starlette refuses middleware after start)."""
    from sglang.srt.entrypoints import http_server

    if not any(m.cls is RequestGate for m in http_server.app.user_middleware):
        http_server.app.add_middleware(
            RequestGate, context_len_fn=lambda: http_server.get_global_state().tokenizer_manager.context_len
        )
    return None


HOOK = Hook(
    "http_request_gate",
    "sglang.srt.entrypoints.http_server:launch_server",
    (
        "server_args",
        "init_tokenizer_manager_func",
        "run_scheduler_process_func",
        "run_detokenizer_process_func",
        "execute_warmup_func",
        "launch_callback",
    ),
    "BEFORE",
    add_request_gate,
)
