"""Requests that must not take a DeepSeek-V4 server down, through a real SGLang server.

1. Each class the plugin refuses gets a 4xx whose message names the field and range, the server
   keeps serving, and a fixed greedy probe returns the same tokens afterwards.
2. A fuzz run: about a thousand generated malformed or extreme requests (fixed seed, four in
   flight) across /generate, /v1/completions and /v1/chat/completions, streamed and batched too
   (numeric extremes: float32 / int32 / float64 edges, +-inf as huge or non-standard literals,
   NaN-like strings, zeros), against a server without speculation, DSpark adaptive, NextN tree
   (topk 4) and DSpark adaptive under --tp-size 2: no 5xx, none slower than a bound, /health OK
   and no KV token held after each class, the probe unchanged at the end.
3. A prompt the KV pool cannot hold with room for output (limits from /get_server_info) is refused
   at once, a small request right after it is answered promptly, and the longest prompt that fits
   is served.
"""

import json
import os
import random
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_dsv4_ascend import settings
from sglang_dsv4_ascend.bench import headline

pytestmark = pytest.mark.e2e

VOCAB = 1024  # the random tiny checkpoint's
DESYNC_MARK = "speculative decisions differ across TP ranks"
CONCURRENCY = 4  # fuzz requests in flight at once
SLOW = 30.0  # seconds: no single request may take longer (valid ones generate <= 8 tokens)
PROBE = {
    "input_ids": [5, 77, 300, 12, 9, 640, 41, 2, 18, 999, 3, 64, 128, 256, 511, 7, 8, 30],
    "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def server(server_pool, tiny_checkpoint):
    return server_pool.get(tiny_checkpoint("flash", "nextn"), env={"SGLANG_DSV4_MAX_REQUEST_BYTES": str(256 << 10)})


def send(srv, path, body, *, raw: bytes | None = None, ctype="application/json"):
    """-> (status, parsed body or text, seconds). Never raises on an HTTP status."""
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(srv.url + path, data=data, headers={"Content-Type": ctype})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    dt = time.monotonic() - t0
    try:
        return status, json.loads(text), dt
    except json.JSONDecodeError:
        return status, text, dt


def unbounded(path, body) -> bool:
    """A request with no output bound (sampling_params null / {} / [], max_new_tokens or max_tokens
    null or absent): valid, and the trained model writes until its EOS, minutes on this CPU."""
    if not isinstance(body, dict):
        return False
    if path == "/generate":
        sp = body.get("sampling_params")
        return sp in (None, {}, []) or (isinstance(sp, dict) and sp.get("max_new_tokens") is None)
    return body.get("max_tokens") is None and body.get("max_completion_tokens") is None


def send_and_hang_up(srv, path, body, chunks=3):
    """Stream it, read a few chunks, hang up (SGLang aborts the request when its stream's client is
    gone) -> (status, first chunks or error body, seconds)."""
    data = json.dumps({**body, "stream": True}).encode()
    req = urllib.request.Request(srv.url + path, data=data, headers={"Content-Type": "application/json"})
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=SLOW) as r:
            status, seen = r.status, []
            for line in r:
                if line.startswith(b"data: "):
                    seen.append(line.decode(errors="replace"))
                if len(seen) >= chunks:
                    break
            text = "".join(seen)
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode(errors="replace")
    return status, text, time.monotonic() - t0


def probe(srv):
    status, out, _ = send(srv, "/generate", PROBE)
    assert status == 200, out
    return out["output_ids"]


def healthy(srv) -> bool:
    try:
        return srv.get("/health", timeout=30)[0] == 200
    except OSError:
        return False


def message(out) -> str:
    return json.dumps(out)


CHAT = [{"role": "user", "content": "How many eggs?"}]
REFUSED = [  # (name, path, body, status, words the message must contain)
    (
        "oov id",
        "/generate",
        {"input_ids": [1, 2, VOCAB], "sampling_params": {"max_new_tokens": 2}},
        400,
        ["input_ids", f"[0, {VOCAB})"],
    ),
    (
        "negative id",
        "/generate",
        {"input_ids": [1, -3], "sampling_params": {"max_new_tokens": 2}},
        400,
        ["input_ids", "-3"],
    ),
    (
        "oov id in a batch",
        "/generate",
        {"input_ids": [[1, 2], [3, VOCAB + 9]], "sampling_params": {"max_new_tokens": 2}},
        400,
        ["input_ids", str(VOCAB + 9)],
    ),
    (
        "oov id, completions",
        "/v1/completions",
        {"model": "m", "prompt": [4, VOCAB + 1], "max_tokens": 2},
        400,
        ["input_ids", f"[0, {VOCAB})"],
    ),
    (
        "top_logprobs_num > vocab",
        "/generate",
        {"text": "hi", "return_logprob": True, "top_logprobs_num": VOCAB + 1, "sampling_params": {"max_new_tokens": 2}},
        400,
        ["top_logprobs_num", f"[0, {VOCAB}]"],
    ),
    (
        "top_logprobs_num < 0",
        "/generate",
        {"text": "hi", "return_logprob": True, "top_logprobs_num": -2, "sampling_params": {"max_new_tokens": 2}},
        400,
        ["top_logprobs_num"],
    ),
    (
        "completions logprobs > vocab",
        "/v1/completions",
        {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": VOCAB + 5},
        400,
        ["logprobs", f"[0, {VOCAB}]"],
    ),
    (
        "chat top_logprobs > vocab",
        "/v1/chat/completions",
        {"model": "m", "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": VOCAB + 1},
        400,
        ["top_logprobs", f"[0, {VOCAB}]"],
    ),
    (
        "logprob_start_len < -1",
        "/generate",
        {"text": "hi", "return_logprob": True, "logprob_start_len": -5, "sampling_params": {"max_new_tokens": 2}},
        400,
        ["logprob_start_len", "-5"],
    ),
    (
        "logprob_start_len past the prompt",
        "/generate",
        {
            "input_ids": [1, 2, 3],
            "return_logprob": True,
            "logprob_start_len": 3,
            "sampling_params": {"max_new_tokens": 2},
        },
        400,
        ["logprob_start_len", "[0, 3)"],
    ),
    (
        "text and input_ids",
        "/generate",
        {"text": "hi", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
        400,
        ["text and input_ids"],
    ),
    (
        "input_embeds zeros",
        "/generate",
        {"input_embeds": [[0.0] * 64] * 3, "sampling_params": {"max_new_tokens": 2}},
        400,
        ["input_embeds", "not supported"],
    ),
    (
        "input_embeds wrong width",
        "/generate",
        {"input_embeds": [[1.0] * 7] * 3, "sampling_params": {"max_new_tokens": 2}},
        400,
        ["input_embeds"],
    ),
    (
        "n too large",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 1000}},
        400,
        ["n = 1000", "SGLANG_DSV4_MAX_N"],
    ),
    (
        "n too large, completions",
        "/v1/completions",
        {"model": "m", "prompt": "hi", "max_tokens": 2, "n": 65},
        400,
        ["n = 65"],
    ),
]
F32 = "[0, 3.4028235e+38]"  # the temperature range in the refusal
ROUTES = {  # route -> a request on it with these sampling fields (OpenAI names where they differ)
    "/generate": lambda **f: {"text": "hi", "sampling_params": {"max_new_tokens": 2, **f}},
    "/v1/completions": lambda **f: {"model": "m", "prompt": "hi", "max_tokens": 2, **f},
    "/v1/chat/completions": lambda **f: {"model": "m", "messages": CHAT, "max_tokens": 2, **f},
}
for _path, _make in ROUTES.items():
    REFUSED += [
        (f"temperature past float32, {_path}", _path, _make(temperature=1e39), 400, ["temperature", F32]),
        (f"temperature 1e308, {_path}", _path, _make(temperature=1e308), 400, ["temperature", F32]),
        (f"top_k 0, {_path}", _path, _make(top_k=0, temperature=0.7), 400, ["top_k = 0", f"[1, {VOCAB}]"]),
        (f"top_k 0 greedy, {_path}", _path, _make(top_k=0, temperature=0), 400, ["top_k = 0", f"[1, {VOCAB}]"]),
        (f"n 0, {_path}", _path, _make(n=0), 400, ["n = 0", "[1, 64]"]),
        (
            f"logit_bias past its range, {_path}",
            _path,
            _make(logit_bias={"5": 1e39}),
            400,
            ["logit_bias", "[-100, 100]"],
        ),
        (f"streamed n 0, {_path}", _path, {**_make(n=0), "stream": True}, 400, ["n = 0"]),
        (f"streamed top_k 0, {_path}", _path, {**_make(top_k=0), "stream": True}, 400, ["top_k = 0"]),
    ]
REFUSED += [
    (
        "streamed oov id",
        "/generate",
        {"input_ids": [1, VOCAB], "stream": True, "sampling_params": {"max_new_tokens": 2}},
        400,
        ["input_ids", f"[0, {VOCAB})"],
    ),
    (
        "streamed temperature past float32, batched",
        "/generate",
        {"text": ["a", "b"], "stream": True, "sampling_params": [{"max_new_tokens": 2}, {"temperature": 1e39}]},
        400,
        ["temperature", F32],
    ),
    (
        "min_new_tokens past the context",
        "/generate",
        {"text": "hi", "sampling_params": {"max_new_tokens": None, "min_new_tokens": 2**31}},
        400,
        ["min_new_tokens"],
    ),
    (
        "stop_token_ids outside the vocabulary",
        "/generate",
        {"text": "hi", "sampling_params": {"stop_token_ids": [2**63]}},
        400,
        ["stop_token_ids", f"[0, {VOCAB})"],
    ),
    # SGLang parses bodies with orjson, which refuses the Infinity / NaN literals; the OpenAI routes
    # read these strings as floats
    (
        "temperature 'inf', completions",
        "/v1/completions",
        ROUTES["/v1/completions"](temperature="inf"),
        400,
        ["temperature", F32],
    ),
    (
        "temperature '-Infinity', chat",
        "/v1/chat/completions",
        ROUTES["/v1/chat/completions"](temperature="-Infinity"),
        400,
        ["temperature", F32],
    ),
    (
        "nested 300 levels",
        "/generate",
        {"text": "hi", "custom_params": json.loads("[" * 300 + "]" * 300)},
        400,
        ["nested deeper than 64"],
    ),
    (
        "nested 300 levels, chat",
        "/v1/chat/completions",
        {"model": "m", "messages": CHAT, "x": json.loads('{"a":' * 300 + "1" + "}" * 300)},
        400,
        ["nested deeper than 64"],
    ),
]


def test_refused_requests_name_the_field_and_the_server_keeps_serving(server):
    before = probe(server)
    for name, path, body, status, words in REFUSED:
        got, out, dt = send(server, path, body)
        assert got == status, (name, got, out)
        text = message(out)
        assert all(w in text for w in words), (name, text)
        assert dt < SLOW, (name, dt)
    # A body over the limit is refused before it is parsed or tokenized (10 MB of text).
    big = json.dumps({"text": "x" * (10 << 20), "sampling_params": {"max_new_tokens": 2}}).encode()
    got, out, dt = send(server, "/generate", None, raw=big)
    assert got == 413 and "SGLANG_DSV4_MAX_REQUEST_BYTES" in message(out) and dt < 5, (got, dt)
    got, out, dt = send(
        server,
        "/v1/chat/completions",
        None,
        raw=json.dumps({"model": "m", "messages": [{"role": "user", "content": "y" * (1 << 20)}]}).encode(),
    )
    assert got == 413 and dt < 5
    assert healthy(server)
    assert probe(server) == before
    # valid neighbours of the refused values still work (a top_k above the vocabulary: every token)
    for body in (
        {"input_ids": [0, VOCAB - 1], "sampling_params": {"max_new_tokens": 2}},
        {"text": "hi", "return_logprob": True, "top_logprobs_num": VOCAB, "sampling_params": {"max_new_tokens": 1}},
        {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 2}},
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 3.4e38, "top_k": VOCAB}},
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0.7, "top_k": 2**31}},
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 0.7, "top_k": 10**12}},
        {"text": "hi", "sampling_params": {"max_new_tokens": 2, "logit_bias": {"5": -100}}},
    ):
        got, out, _ = send(server, "/generate", body)
        assert got == 200, (body, out)
    for path, make in ROUTES.items():  # a stream that passes validation still streams
        got, out, _ = send(server, path, {**make(temperature=0.7, top_k=-1), "stream": True})
        assert got == 200 and "data: [DONE]" in out, (path, out)


# ------------------------------------------------------------------------------------------------
# Fuzz: generated requests, fixed seed. Each class returns (path, body or raw bytes) pairs for a
# server whose vocabulary has V tokens.

GARBAGE = [
    "",
    " ",
    "\x00",
    "\ufffd" * 5,
    "😀" * 40,
    "\u202e\u200b",
    "<｜begin▁of▁sentence｜>" * 3,
    "<｜User｜><｜Assistant｜>",
    "\\u0000",
    "a" * 3000,
    "\n" * 200,
    "ﷺ" * 30,
]
WRONG = [None, True, -1, 0, 1.5, 1e308, "x", "", [], [1], {}, {"a": 1}, [[1]], "NaN", 2**63]


def _gen(rng, ids=None):
    return {"sampling_params": {"max_new_tokens": rng.randint(0, 4)}, **(ids or {"text": rng.choice(GARBAGE)})}


def cls_prompts(rng, V):
    out = []
    for _ in range(20):
        out.append(("/generate", _gen(rng)))
        out.append(("/v1/completions", {"model": "m", "prompt": rng.choice(GARBAGE), "max_tokens": rng.randint(1, 4)}))
        out.append(
            (
                "/v1/chat/completions",
                {
                    "model": "m",
                    "max_tokens": rng.randint(1, 4),
                    "messages": [{"role": "user", "content": rng.choice(GARBAGE)}],
                },
            )
        )
    out.append(("/generate", {"input_ids": [0], "sampling_params": {"max_new_tokens": 2}}))  # only BOS
    out.append(("/generate", {"input_ids": [1, 1, 1], "sampling_params": {"max_new_tokens": 2}}))  # only EOS
    return out


def cls_bad_json(rng, V):
    raws = [
        b"",
        b"{",
        b"[]",
        b"null",
        b"42",
        b'{"text": "hi",}',
        b'{"text": "\xff\xfe"}',
        b'{"text": "\\ud800"}',
        b"{'text': 'hi'}",
        b'{"text": "hi"}' * 2,
        b"\x00" * 64,
        b'{"sampling_params": {"max_new_tokens": 1e999}}',
        # a RecursionError in the gate's json; a 500 further on
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 30_000 + b"1" + b"}" * 30_000,
        b"[" * 300 + b"]" * 300,
        b'{"text": "hi", "x": ' + b'{"a":' * 300 + b"1" + b"}" * 301,
    ]
    out = [(p, r) for r in raws for p in ("/generate", "/v1/completions", "/v1/chat/completions")]
    out += [("/generate", (b'{"text": "hi"}', "text/plain"))]
    return out


def cls_wrong_types(rng, V):
    fields = {
        "/generate": [
            "text",
            "input_ids",
            "sampling_params",
            "stream",
            "return_logprob",
            "top_logprobs_num",
            "logprob_start_len",
            "rid",
            "lora_path",
            "return_text_in_logprobs",
        ],
        "/v1/completions": [
            "prompt",
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "stop",
            "logprobs",
            "echo",
            "seed",
            "stream",
            "logit_bias",
            "model",
            "presence_penalty",
        ],
        "/v1/chat/completions": [
            "messages",
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "stop",
            "logprobs",
            "top_logprobs",
            "tools",
            "tool_choice",
            "response_format",
            "stream",
            "seed",
            "stream_options",
            "logit_bias",
        ],
    }
    base = {
        "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
        "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 2},
        "/v1/chat/completions": {"model": "m", "messages": CHAT, "max_tokens": 2},
    }
    out = []
    for path, names in fields.items():
        for name in names:
            for value in rng.sample(WRONG, 4):
                out.append((path, {**base[path], name: value}))
    params = [
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "n",
        "stop",
        "stop_token_ids",
        "frequency_penalty",
        "repetition_penalty",
        "ignore_eos",
        "regex",
        "json_schema",
        "logit_bias",
    ]
    for name in params:
        # max_new_tokens=None is valid (generate to the end of the context), just slow
        for value in rng.sample([w for w in WRONG if not (w is None and name == "max_new_tokens")], 4):
            out.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, name: value}}))
    return out


def cls_lengths_and_sampling(rng, V):
    out = []
    for v in (-(10**9), -1, 0, 10**5, 10**9, 2**63, 1e30):
        out.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": v}}))
        out.append(("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": v}))
        out.append(("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": v}))
    extremes = {
        "temperature": [-1, -1e-9, 0, 1e-30, 1e9, float("inf")],
        "top_p": [-1, 0, 1e-9, 1.0001, 5],
        "top_k": [-2, 0, 1, V, V * 10],
        "min_p": [-0.5, 0, 1, 2],
        "frequency_penalty": [-3, 3, 1e9],
        "presence_penalty": [-3, 3],
        "repetition_penalty": [-1, 0, 1e9],
        "n": [0, -1, 2, 3],
        "seed": [-1, 2**64],
    }
    for name, values in extremes.items():
        for v in values:
            sp = {"max_new_tokens": 3, name: v}
            if name == "seed":
                sp = {"max_new_tokens": 3, "sampling_seed": v}
            out.append(("/generate", {"text": "hi", "sampling_params": sp}))
            if name not in ("min_p", "repetition_penalty", "top_k"):
                out.append(("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 3, name: v}))
    return out  # inf is sent as JSON's non-standard Infinity: a parse error the server must answer


F32_EDGES = [3.4e38, 3.5e38, 1e39, 1e308, -3.5e38]  # float32's largest is 3.4028235e38
I32_EDGES = [2**31 - 1, 2**31, 2**63, 10**12, -(2**31) - 1]
HUGE = [10**400, -(10**400)]  # integer literals past float64, standing for +-inf
NAN_STRINGS = ["NaN", "nan", "inf", "-Infinity", "Infinity"]
EXTREMES = F32_EDGES + I32_EDGES + HUGE + NAN_STRINGS + [0, -1]
OPENAI_NAME = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "sampling_seed": "seed"}
NUMERIC = [
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "n",
    "max_new_tokens",
    "min_new_tokens",
    "sampling_seed",
]


def _on(path, field, value):
    if path == "/generate":
        return {"text": "hi", "sampling_params": {"max_new_tokens": 2, field: value}}
    return {**ROUTES[path](), OPENAI_NAME.get(field, field): value}


def cls_numeric_extremes(rng, V):
    """float32 / int32 / float64 edges, NaN-like strings and zeros in every numeric sampling field
    on every route: all of temperature and top_k (each took servers down), a sample of the rest,
    and the worst of them streamed and batched."""
    out = []
    for path, make in ROUTES.items():
        for field in NUMERIC:
            values = EXTREMES if field in ("temperature", "top_k", "n") else rng.sample(EXTREMES, 5)
            out += [(path, _on(path, field, v)) for v in values]
        for v in rng.sample(F32_EDGES + HUGE + NAN_STRINGS, 4):
            out.append((path, make(logit_bias={"5": v})))
        for field, v in (("temperature", 1e39), ("top_k", 2**31), ("top_k", 0), ("n", 0), ("temperature", "NaN")):
            out.append((path, {**_on(path, field, v), "stream": True}))
    for field in ("stream_interval", "stop_token_ids"):
        for v in I32_EDGES + HUGE:
            out.append(("/generate", _on("/generate", field, [v] if field == "stop_token_ids" else v)))
    for v in (1e39, 2**31, 0, 10**12):
        sp = [{"max_new_tokens": 2}, {"max_new_tokens": 2, "temperature": v}, {"max_new_tokens": 2, "top_k": v}]
        out.append(("/generate", {"text": ["a", "b", "c"], "sampling_params": sp}))
        out.append(("/generate", {"text": ["a", "b", "c"], "sampling_params": sp, "stream": True}))
    return out


def cls_inf_literals(rng, V):
    """Number literals some JSON parsers read as +-inf or NaN (1e999, and Python's NaN / Infinity;
    SGLang's orjson refuses them), sent raw: json.dumps cannot write them."""
    out = []
    for lit in (b"1e999", b"-1e999", b"NaN", b"Infinity", b"-Infinity"):
        for field in ("temperature", "top_p", "top_k", "n", "min_p", "repetition_penalty"):
            out.append(
                (
                    "/generate",
                    b'{"text": "hi", "sampling_params": {"max_new_tokens": 2, "'
                    + field.encode()
                    + b'": '
                    + lit
                    + b"}}",
                )
            )
            for path in ("/v1/completions", "/v1/chat/completions"):
                body = json.dumps(ROUTES[path](**{field: "__LIT__"})).encode()
                out.append((path, body.replace(b'"__LIT__"', lit)))
    return out


def cls_stops(rng, V):
    out = []
    for k in (0, 1, 33, 1000):
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 6))) for _ in range(k)]
        out.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3, "stop": stops}}))
        out.append(("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3, "stop": stops}))
    for ids in ([], [0], [V + 3], [-1], list(range(2000))):
        out.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3, "stop_token_ids": ids}}))
    out.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3, "stop": ["x" * 100000]}}))
    return out


def cls_vocab(rng, V):
    out = []
    for _ in range(30):
        ids = [rng.randint(0, V - 1) for _ in range(rng.randint(1, 40))]
        ids[rng.randrange(len(ids))] = rng.choice([V, V + 1, 2**31 - 1, 2**40, -1, -(2**31)])
        out.append(("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}))
        out.append(("/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 2}))
    out.append(("/generate", {"input_ids": [[1, 2], [3, V]], "sampling_params": {"max_new_tokens": 2}}))
    out.append(("/v1/completions", {"model": "m", "prompt": [[1, 2], [V, 3]], "max_tokens": 2}))
    out.append(("/generate", {"input_ids": [[]], "sampling_params": {"max_new_tokens": 2}}))
    return out


def cls_logprobs(rng, V):
    out = []
    for k in (-(2**31), -1, 0, 1, 5, V - 1, V, V + 1, 10**6):
        for start in (-9, -1, 0, 2, 100):
            out.append(
                (
                    "/generate",
                    {
                        "input_ids": [1, 2, 3, 4],
                        "return_logprob": True,
                        "top_logprobs_num": k,
                        "logprob_start_len": start,
                        "sampling_params": {"max_new_tokens": 2},
                    },
                )
            )
        out.append(
            (
                "/v1/completions",
                {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": k, "echo": rng.random() < 0.5},
            )
        )
        out.append(
            (
                "/v1/chat/completions",
                {"model": "m", "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": k},
            )
        )
    out.append(
        (
            "/generate",
            {
                "text": "hi",
                "return_logprob": True,
                "token_ids_logprob": [V + 4],
                "sampling_params": {"max_new_tokens": 2},
            },
        )
    )
    return out


def cls_conflicts(rng, V):
    return [
        ("/generate", {"text": "hi", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": ["a", "b"], "input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 2}}),
        # one text, nested ids: reached the vocabulary check as a list of lists (a 500)
        ("/generate", {"text": "hi", "input_ids": [[1]], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"input_embeds": [[0.0] * 64], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"input_embeds": [[[1.0] * 3] * 2], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": "hi", "input_embeds": [[0.5] * 64], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": ["a", "b", "c"], "sampling_params": [{"max_new_tokens": 1}]}),
        ("/generate", {"text": [], "sampling_params": {"max_new_tokens": 1}}),
        ("/generate", {"text": ["ok", "x" * 2000, ""], "sampling_params": {"max_new_tokens": 1}}),
    ]


def cls_chat(rng, V):
    msgs = [
        [],
        [{}],
        [{"role": "user"}],
        [{"content": "hi"}],
        [{"role": "bogus", "content": "hi"}],
        [{"role": "user", "content": None}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
        [{"role": "user", "content": [{"type": "text"}]}],
        [{"role": "user", "content": [{"type": "nope", "text": "x"}]}],
        [{"role": "assistant", "content": "hi"}],
        [{"role": "system", "content": "s"}],
        [{"role": "tool", "content": "x", "tool_call_id": 5}],
        [{"role": "user", "content": "hi"}] * 300,
        [{"role": "user", "content": "hi", "extra": {"deep": [1, 2, {"x": None}]}}],
        [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{bad"}}],
            }
        ],
    ]
    out = [("/v1/chat/completions", {"model": "m", "messages": m, "max_tokens": 2}) for m in msgs]
    out.append(
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": CHAT,
                "max_tokens": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}},
            },
        )
    )
    out.append(
        (
            "/v1/chat/completions",
            {
                "model": "m",
                "messages": CHAT,
                "max_tokens": 2,
                "tools": [{"type": "function", "function": {"name": ""}}],
                "tool_choice": "required",
            },
        )
    )
    return out


def cls_streams(rng, V):
    out = []
    for path, body in cls_vocab(rng, V)[:6] + cls_conflicts(rng, V)[:3] + cls_logprobs(rng, V)[::9]:
        out.append((path, {**body, "stream": True}))
    return out


CLASSES = [
    cls_prompts,
    cls_bad_json,
    cls_wrong_types,
    cls_lengths_and_sampling,
    cls_numeric_extremes,
    cls_inf_literals,
    cls_stops,
    cls_vocab,
    cls_logprobs,
    cls_conflicts,
    cls_chat,
    cls_streams,
]


# The speculative and parallel servers the fuzz also runs against: (headline method, flags,
# environment) on top of headline.METHODS, the same keys their other tests use, so no server starts
# for the fuzz alone (tests/e2e/conftest.py SCHEDULE puts each next to its other users).
SPECULATIVE = {
    "dspark_adaptive": ("dspark_adaptive", (), {}),
    "nextn_tree4": ("nextn_tree4", (), {}),
    # test_parallel_serving.py's: the cross-rank decision check on, so a desync would stop it
    "dspark_adaptive_tp2": ("dspark_adaptive", ("--tp-size", "2"), {settings.SPEC_SYNC_CHECK.name: "1"}),
}
# A quarter of each class on each speculative server, a different quarter on each (seeded by the
# config's name, so the same draw every run): the whole set against each was ~190 s of CI (a
# third, ~38 s each), a refusal is the same code whatever the server's method or ranks, and every
# served class still reaches each server's draft and verify (and on two ranks, its decision
# check); the no-speculation server takes every case.
# The two-rank server a sixth, and 3 of the long garbage prompts (their prefill over two ranks
# on two cores was most of its ~65 s): what it adds is its ranks' decisions staying in sync.
SHARE = {**dict.fromkeys(SPECULATIVE, 4), "dspark_adaptive_tp2": 6}


def fuzz_server(request, servers, config):
    """-> (server, its vocabulary size)."""
    if config == "no_speculation":
        return request.getfixturevalue("server"), VOCAB
    method, flags, env = SPECULATIVE[config]
    path, method_env, method_flags = headline.METHODS[method]
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    return servers.get(path, *headline.POOL, *method_flags, *flags, env={**method_env, **env}), vocab


def settled(srv, timeout=20.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := srv.used_tokens()) and time.monotonic() < deadline:
        time.sleep(0.25)
    return n


@pytest.mark.parametrize("config", ["no_speculation", *SPECULATIVE])
def test_request_fuzz_never_breaks_the_server(request, servers, config):
    """The same classes against a server without speculation, DSpark adaptive, NextN tree (topk 4)
    and DSpark adaptive on two ranks: no 5xx, no request over the bound, /health OK and no KV
    token left held after each class, the greedy probe unchanged at the end (and on two ranks,
    the decision check silent). A valid request without an output bound is streamed and dropped
    after its first chunks."""
    server, vocab = fuzz_server(request, servers, config)
    rng, pick = random.Random(20261202), random.Random(config)
    # two ranks on two cores beside the other test worker: a 3000-token garbage prompt's prefill
    # queued behind three others took 32 s in CI; a stalled request still takes forever
    limit = 2 * SLOW if config.endswith("_tp2") else SLOW
    before = probe(server)
    total = 0

    def one(case):
        path, body = case
        if isinstance(body, tuple):
            return send(server, path, None, raw=body[0], ctype=body[1])
        if isinstance(body, bytes):
            return send(server, path, None, raw=body)
        if unbounded(path, body):  # streamed and dropped: the abort must free its cache too
            return send_and_hang_up(server, path, body)
        return send(server, path, body)

    for cls in CLASSES:
        cases = cls(rng, vocab)
        if config != "no_speculation" and cls is cls_prompts:
            # its long garbage prompts are the fuzz's cost (16 s for 20 of them on a DSpark server,
            # alone; twice that in CI); the no-speculation server takes them all
            cases = pick.sample(cases, 6 if SHARE[config] <= 4 else 3)
        elif config in SHARE:
            cases = pick.sample(cases, -(-len(cases) // SHARE[config]))
        with ThreadPoolExecutor(CONCURRENCY) as ex:  # batched with each other, as clients would be
            for (path, body), (status, out, dt) in zip(cases, ex.map(one, cases)):
                ctx = (cls.__name__, path, json.dumps(body, default=repr)[:300], status, str(out)[:300])
                assert status < 500, ctx
                assert dt < limit, (dt,) + ctx
        total += len(cases)
        assert healthy(server), f"/health failed after {cls.__name__}\n{server.log_tail(60)}"
        assert settled(server) == 0, f"KV tokens still held after {cls.__name__}"
    assert total >= 900 // SHARE.get(config, 1)
    assert probe(server) == before
    assert DESYNC_MARK not in server.log_text()


def test_a_request_the_pool_cannot_hold_is_refused_and_stalls_no_one(server):
    """SGLang's scheduler clips a request's budget to the pool left after its prompt's pages and one
    more page, and admits it only while prompt + budget + one page < pool (request_guard
    .output_budget). A longer prompt used to be answered with no output after its whole prefill, or,
    past pool - 1 page, never scheduled while every later request waited behind it. The limits come
    from the server's own record; the longest prompt with room for output is served."""
    info = server.server_info()
    pool, page, ctx = info["max_total_num_tokens"], info["page_size"], info["context_length"]
    avail = pool // page * page
    most = avail - 2 * page  # the prompt's pages, one page of output, the page kept free per request
    assert most + page < min(ctx, pool) - 6, "the pool must bind before SGLang's own input limit"
    ids = lambda n: [(i * 7919) % (VOCAB - 1) + 1 for i in range(n)]  # noqa: E731
    refused = [(most + 1, 4), (most + page, 1), (avail - page + 20, 60), (avail - page, 0)]
    for n, m in refused:
        got, out, dt = send(server, "/generate", {"input_ids": ids(n), "sampling_params": {"max_new_tokens": m}})
        text = message(out)
        assert got == 400, (n, m, got, text[:300])
        for words in (
            f"input_ids: {n} prompt tokens + max_new_tokens {m}",
            f"holds {pool} tokens",
            f"{page}-token pages",
            "--max-total-tokens",
            f"At most {most} prompt tokens",
        ):
            assert words in text, (words, text)
        assert dt < 10, (n, m, dt)
    got, out, dt = send(server, "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": {"max_new_tokens": 4}})
    assert got == 200 and len(out["output_ids"]) <= 4 and dt < 15, (got, dt, out)
    params = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
    got, out, _ = send(server, "/generate", {"input_ids": ids(most), "sampling_params": params})
    assert got == 200 and len(out["output_ids"]) == 2, (got, str(out)[:300])
    assert healthy(server)
