"""Requests that must not take a DeepSeek-V4 server down, through a real SGLang server.

1. Each class the plugin refuses gets a 4xx whose message names the field and range, the server
   keeps serving, and a fixed greedy probe returns the same tokens afterwards.
2. A fuzz run: a few hundred generated malformed or extreme requests (fixed seed) across
   /generate, /v1/completions and /v1/chat/completions: no 5xx, none slower than a bound,
   /health OK after each class, the probe unchanged at the end.
"""

import json
import random
import time
import urllib.error
import urllib.request

import pytest

pytestmark = pytest.mark.e2e

VOCAB = 1024  # the tiny checkpoint's
SLOW = 30.0  # seconds: no single request may take longer (valid ones generate <= 8 tokens)
PROBE = {"input_ids": [5, 77, 300, 12, 9, 640, 41, 2, 18, 999, 3, 64, 128, 256, 511, 7, 8, 30],
         "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}}


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
    ("oov id", "/generate", {"input_ids": [1, 2, VOCAB], "sampling_params": {"max_new_tokens": 2}},
     400, ["input_ids", f"[0, {VOCAB})"]),
    ("negative id", "/generate", {"input_ids": [1, -3], "sampling_params": {"max_new_tokens": 2}}, 400, ["input_ids", "-3"]),
    ("oov id in a batch", "/generate",
     {"input_ids": [[1, 2], [3, VOCAB + 9]], "sampling_params": {"max_new_tokens": 2}}, 400, ["input_ids", str(VOCAB + 9)]),
    ("oov id, completions", "/v1/completions", {"model": "m", "prompt": [4, VOCAB + 1], "max_tokens": 2},
     400, ["input_ids", f"[0, {VOCAB})"]),
    ("top_logprobs_num > vocab", "/generate",
     {"text": "hi", "return_logprob": True, "top_logprobs_num": VOCAB + 1, "sampling_params": {"max_new_tokens": 2}},
     400, ["top_logprobs_num", f"[0, {VOCAB}]"]),
    ("top_logprobs_num < 0", "/generate",
     {"text": "hi", "return_logprob": True, "top_logprobs_num": -2, "sampling_params": {"max_new_tokens": 2}},
     400, ["top_logprobs_num"]),
    ("completions logprobs > vocab", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": VOCAB + 5},
     400, ["logprobs", f"[0, {VOCAB}]"]),
    ("chat top_logprobs > vocab", "/v1/chat/completions",
     {"model": "m", "messages": CHAT, "max_tokens": 2, "logprobs": True, "top_logprobs": VOCAB + 1},
     400, ["top_logprobs", f"[0, {VOCAB}]"]),
    ("logprob_start_len < -1", "/generate",
     {"text": "hi", "return_logprob": True, "logprob_start_len": -5, "sampling_params": {"max_new_tokens": 2}},
     400, ["logprob_start_len", "-5"]),
    ("logprob_start_len past the prompt", "/generate",
     {"input_ids": [1, 2, 3], "return_logprob": True, "logprob_start_len": 3, "sampling_params": {"max_new_tokens": 2}},
     400, ["logprob_start_len", "[0, 3)"]),
    ("text and input_ids", "/generate", {"text": "hi", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}},
     400, ["text and input_ids"]),
    ("input_embeds zeros", "/generate", {"input_embeds": [[0.0] * 64] * 3, "sampling_params": {"max_new_tokens": 2}},
     400, ["input_embeds", "not supported"]),
    ("input_embeds wrong width", "/generate", {"input_embeds": [[1.0] * 7] * 3, "sampling_params": {"max_new_tokens": 2}},
     400, ["input_embeds"]),
    ("n too large", "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, "n": 1000}},
     400, ["n = 1000", "SGLANG_DSV4_MAX_N"]),
    ("n too large, completions", "/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "n": 65},
     400, ["n = 65"]),
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
    got, out, dt = send(server, "/v1/chat/completions", None, raw=json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "y" * (1 << 20)}]}).encode())
    assert got == 413 and dt < 5
    assert healthy(server)
    assert probe(server) == before
    # valid neighbours of the refused values still work
    for body in ({"input_ids": [0, VOCAB - 1], "sampling_params": {"max_new_tokens": 2}},
                 {"text": "hi", "return_logprob": True, "top_logprobs_num": VOCAB, "sampling_params": {"max_new_tokens": 1}},
                 {"text": "hi", "sampling_params": {"max_new_tokens": 1, "n": 2}}):
        got, out, _ = send(server, "/generate", body)
        assert got == 200, (body, out)


# ------------------------------------------------------------------------------------------------
# Fuzz: generated requests, fixed seed. Each class returns (path, body or raw bytes) pairs.

GARBAGE = ["", " ", "\x00", "\ufffd" * 5, "😀" * 40, "\u202e\u200b", "<｜begin▁of▁sentence｜>" * 3,
           "<｜User｜><｜Assistant｜>", "\\u0000", "a" * 3000, "\n" * 200, "ﷺ" * 30]
WRONG = [None, True, -1, 0, 1.5, 1e308, "x", "", [], [1], {}, {"a": 1}, [[1]], "NaN", 2**63]


def _gen(rng, ids=None):
    return {"sampling_params": {"max_new_tokens": rng.randint(0, 4)}, **(ids or {"text": rng.choice(GARBAGE)})}


def cls_prompts(rng):
    out = []
    for _ in range(20):
        out.append(("/generate", _gen(rng)))
        out.append(("/v1/completions", {"model": "m", "prompt": rng.choice(GARBAGE), "max_tokens": rng.randint(1, 4)}))
        out.append(("/v1/chat/completions", {"model": "m", "max_tokens": rng.randint(1, 4),
                                             "messages": [{"role": "user", "content": rng.choice(GARBAGE)}]}))
    out.append(("/generate", {"input_ids": [0], "sampling_params": {"max_new_tokens": 2}}))  # only BOS
    out.append(("/generate", {"input_ids": [1, 1, 1], "sampling_params": {"max_new_tokens": 2}}))  # only EOS
    return out


def cls_bad_json(rng):
    raws = [b"", b"{", b"[]", b"null", b"42", b'{"text": "hi",}', b'{"text": "\xff\xfe"}', b'{"text": "\\ud800"}',
            b"{'text': 'hi'}", b'{"text": "hi"}' * 2, b"\x00" * 64, b'{"sampling_params": {"max_new_tokens": 1e999}}']
    out = [(p, r) for r in raws for p in ("/generate", "/v1/completions", "/v1/chat/completions")]
    out += [("/generate", (b'{"text": "hi"}', "text/plain"))]
    return out


def cls_wrong_types(rng):
    fields = {
        "/generate": ["text", "input_ids", "sampling_params", "stream", "return_logprob", "top_logprobs_num",
                      "logprob_start_len", "rid", "lora_path", "return_text_in_logprobs"],
        "/v1/completions": ["prompt", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "echo", "seed",
                            "stream", "logit_bias", "model", "presence_penalty"],
        "/v1/chat/completions": ["messages", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs",
                                 "top_logprobs", "tools", "tool_choice", "response_format", "stream", "seed",
                                 "stream_options", "logit_bias"],
    }
    base = {"/generate": {"text": "hi", "sampling_params": {"max_new_tokens": 2}},
            "/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 2},
            "/v1/chat/completions": {"model": "m", "messages": CHAT, "max_tokens": 2}}
    out = []
    for path, names in fields.items():
        for name in names:
            for value in rng.sample(WRONG, 4):
                out.append((path, {**base[path], name: value}))
    params = ["max_new_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "stop_token_ids",
              "frequency_penalty", "repetition_penalty", "ignore_eos", "regex", "json_schema", "logit_bias"]
    for name in params:
        # max_new_tokens=None is valid (generate to the end of the context), just slow
        for value in rng.sample([w for w in WRONG if not (w is None and name == "max_new_tokens")], 4):
            out.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 2, name: value}}))
    return out


def cls_lengths_and_sampling(rng):
    out = []
    for v in (-10**9, -1, 0, 10**5, 10**9, 2**63, 1e30):
        out.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": v}}))
        out.append(("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": v}))
        out.append(("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": v}))
    extremes = {"temperature": [-1, -1e-9, 0, 1e-30, 1e9, float("inf")], "top_p": [-1, 0, 1e-9, 1.0001, 5],
                "top_k": [-2, 0, 1, VOCAB, VOCAB * 10], "min_p": [-0.5, 0, 1, 2],
                "frequency_penalty": [-3, 3, 1e9], "presence_penalty": [-3, 3], "repetition_penalty": [-1, 0, 1e9],
                "n": [0, -1, 2, 3], "seed": [-1, 2**64]}
    for name, values in extremes.items():
        for v in values:
            sp = {"max_new_tokens": 3, name: v}
            if name == "seed":
                sp = {"max_new_tokens": 3, "sampling_seed": v}
            out.append(("/generate", {"text": "hi", "sampling_params": sp}))
            if name not in ("min_p", "repetition_penalty", "top_k"):
                out.append(("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 3, name: v}))
    return out  # inf is sent as JSON's non-standard Infinity: a parse error the server must answer


def cls_stops(rng):
    out = []
    for k in (0, 1, 33, 1000):
        stops = ["".join(rng.choice("abc ") for _ in range(rng.randint(1, 6))) for _ in range(k)]
        out.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3, "stop": stops}}))
        out.append(("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3, "stop": stops}))
    for ids in ([], [0], [VOCAB + 3], [-1], list(range(2000))):
        out.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3, "stop_token_ids": ids}}))
    out.append(("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3, "stop": ["x" * 100000]}}))
    return out


def cls_vocab(rng):
    out = []
    for _ in range(30):
        ids = [rng.randint(0, VOCAB - 1) for _ in range(rng.randint(1, 40))]
        ids[rng.randrange(len(ids))] = rng.choice([VOCAB, VOCAB + 1, 2**31 - 1, 2**40, -1, -(2**31)])
        out.append(("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 2}}))
        out.append(("/v1/completions", {"model": "m", "prompt": ids, "max_tokens": 2}))
    out.append(("/generate", {"input_ids": [[1, 2], [3, VOCAB]], "sampling_params": {"max_new_tokens": 2}}))
    out.append(("/v1/completions", {"model": "m", "prompt": [[1, 2], [VOCAB, 3]], "max_tokens": 2}))
    out.append(("/generate", {"input_ids": [[]], "sampling_params": {"max_new_tokens": 2}}))
    return out


def cls_logprobs(rng):
    out = []
    for k in (-(2**31), -1, 0, 1, 5, VOCAB - 1, VOCAB, VOCAB + 1, 10**6):
        for start in (-9, -1, 0, 2, 100):
            out.append(("/generate", {"input_ids": [1, 2, 3, 4], "return_logprob": True, "top_logprobs_num": k,
                                      "logprob_start_len": start, "sampling_params": {"max_new_tokens": 2}}))
        out.append(("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2, "logprobs": k,
                                        "echo": rng.random() < 0.5}))
        out.append(("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 2, "logprobs": True,
                                             "top_logprobs": k}))
    out.append(("/generate", {"text": "hi", "return_logprob": True, "token_ids_logprob": [VOCAB + 4],
                              "sampling_params": {"max_new_tokens": 2}}))
    return out


def cls_conflicts(rng):
    return [
        ("/generate", {"text": "hi", "input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": ["a", "b"], "input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"input_embeds": [[0.0] * 64], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"input_embeds": [[[1.0] * 3] * 2], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": "hi", "input_embeds": [[0.5] * 64], "sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"sampling_params": {"max_new_tokens": 2}}),
        ("/generate", {"text": ["a", "b", "c"], "sampling_params": [{"max_new_tokens": 1}]}),
        ("/generate", {"text": [], "sampling_params": {"max_new_tokens": 1}}),
        ("/generate", {"text": ["ok", "x" * 2000, ""], "sampling_params": {"max_new_tokens": 1}}),
    ]


def cls_chat(rng):
    msgs = [[], [{}], [{"role": "user"}], [{"content": "hi"}], [{"role": "bogus", "content": "hi"}],
            [{"role": "user", "content": None}], [{"role": "user", "content": 5}],
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}]}],
            [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"type": "nope", "text": "x"}]}],
            [{"role": "assistant", "content": "hi"}], [{"role": "system", "content": "s"}],
            [{"role": "tool", "content": "x", "tool_call_id": 5}], [{"role": "user", "content": "hi"}] * 300,
            [{"role": "user", "content": "hi", "extra": {"deep": [1, 2, {"x": None}]}}],
            [{"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function",
                                                                   "function": {"name": "f", "arguments": "{bad"}}]}]]
    out = [("/v1/chat/completions", {"model": "m", "messages": m, "max_tokens": 2}) for m in msgs]
    out.append(("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 2,
                                         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "bogus"}}}}))
    out.append(("/v1/chat/completions", {"model": "m", "messages": CHAT, "max_tokens": 2,
                                         "tools": [{"type": "function", "function": {"name": ""}}], "tool_choice": "required"}))
    return out


def cls_streams(rng):
    out = []
    for path, body in cls_vocab(rng)[:6] + cls_conflicts(rng)[:3] + cls_logprobs(rng)[::9]:
        out.append((path, {**body, "stream": True}))
    return out


CLASSES = [cls_prompts, cls_bad_json, cls_wrong_types, cls_lengths_and_sampling, cls_stops, cls_vocab,
           cls_logprobs, cls_conflicts, cls_chat, cls_streams]


def test_request_fuzz_never_breaks_the_server(server):
    rng = random.Random(20261202)
    before = probe(server)
    total = 0
    for cls in CLASSES:
        cases = cls(rng)
        for path, body in cases:
            if isinstance(body, tuple):
                status, out, dt = send(server, path, None, raw=body[0], ctype=body[1])
            elif isinstance(body, bytes):
                status, out, dt = send(server, path, None, raw=body)
            else:
                status, out, dt = send(server, path, body)
            ctx = (cls.__name__, path, json.dumps(body, default=repr)[:300], status, str(out)[:300])
            assert status < 500, ctx
            assert dt < SLOW, (dt,) + ctx
        total += len(cases)
        assert healthy(server), f"/health failed after {cls.__name__}\n{server.log_tail(60)}"
    assert total >= 300
    assert probe(server) == before
