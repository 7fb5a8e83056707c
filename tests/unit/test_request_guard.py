"""Request validation at the boundary (request_guard): each check refuses exactly the requests
outside its range, names the field, and leaves valid requests alone; the body-size middleware
refuses oversized bodies before the route reads them, with or without a Content-Length."""

import json
import re
from types import SimpleNamespace

import pytest

from sglang_dsv4_ascend import settings
from sglang_dsv4_ascend.integration import request_guard as G
from sglang_dsv4_ascend.integration.hooks.generate_stream_refusals import stream_refusals_hook
from sglang_dsv4_ascend.integration.hooks.request_normalize_errors import normalize_hook

V = 1024


def req(**kw):
    base = dict(
        text=None,
        input_ids=None,
        input_embeds=None,
        return_logprob=False,
        top_logprobs_num=None,
        logprob_start_len=None,
        sampling_params={},
    )
    base.update(kw)
    return SimpleNamespace(**base)


def ok(obj, ids, dsv4=True):
    G.check_request(obj, ids, vocab_size=V, dsv4=dsv4)


def refused(obj, ids, match, dsv4=True):
    with pytest.raises(G.RequestRejected, match=match):
        G.check_request(obj, ids, vocab_size=V, dsv4=dsv4)


def test_input_ids_must_lie_in_the_vocabulary():
    ok(req(input_ids=[0, V - 1]), [0, V - 1])
    refused(req(input_ids=[1, V]), [1, V], rf"input_ids: token id {V} is outside .*\[0, {V}\)")
    refused(req(input_ids=[-1, 2]), [-1, 2], r"input_ids: token id -1 ")
    # applies to every model: an out-of-range id crashes any embedding
    refused(req(), [5, V + 7], "input_ids", dsv4=False)
    # `text` beside a nested input_ids hands SGLang's validation a list of lists (was a 500, found
    # by the fuzz on a speculative server)
    for ids in ([[1]], [1, [2]], [1.0, 2], [True]):
        refused(req(text="hi", input_ids=ids), ids, r"input_ids: expected one prompt's token ids", dsv4=False)


def test_logprob_counts_are_bounded_by_the_vocabulary():
    ok(req(return_logprob=True, top_logprobs_num=V), [1, 2])
    ok(req(return_logprob=True, top_logprobs_num=0), [1, 2])
    refused(req(return_logprob=True, top_logprobs_num=V + 1), [1, 2], r"top_logprobs_num .* = 1025: .*\[0, 1024\]")
    refused(req(return_logprob=True, top_logprobs_num=-1), [1, 2], "top_logprobs_num", dsv4=False)
    # without return_logprob SGLang ignores the count: so do we
    ok(req(return_logprob=False, top_logprobs_num=V + 5), [1, 2])


def test_logprob_start_len_range():
    ids = [1, 2, 3]
    for good in (-1, 0, 2):
        ok(req(return_logprob=True, logprob_start_len=good), ids)
    for bad in (-2, 3, 1000):
        refused(req(return_logprob=True, logprob_start_len=bad), ids, rf"logprob_start_len = {bad}: .*\[0, 3\)")


def test_parallel_samples_limit_is_configurable(monkeypatch):
    ok(req(sampling_params={"n": settings.MAX_N.default}), [1])
    refused(req(sampling_params={"n": settings.MAX_N.default + 1}), [1], r"n = 65: at most 64 .*SGLANG_DSV4_MAX_N")
    monkeypatch.setenv(settings.MAX_N.name, "2")
    refused(req(sampling_params={"n": 3}), [1], "at most 2")
    monkeypatch.setenv(settings.MAX_N.name, "zero")
    with pytest.raises(ValueError, match="SGLANG_DSV4_MAX_N='zero': expected a positive integer"):
        ok(req(sampling_params={"n": 1}), [1])


def test_dsv4_only_refusals():
    embeds = [[0.0] * 7] * 3
    refused(req(input_embeds=embeds), None, "input_embeds: not supported by the DeepSeek-V4 model")
    ok(req(input_embeds=embeds), None, dsv4=False)  # other models use them
    refused(req(text="hi", input_ids=[1, 2]), [1, 2], "text and input_ids: give one prompt")
    ok(req(text="hi", input_ids=[1, 2]), [1, 2], dsv4=False)
    ok(req(text="hi"), [1, 2])


@pytest.mark.parametrize(
    "field,value",
    [
        ("frequency_penalty", 0.5),
        ("presence_penalty", -0.2),
        ("repetition_penalty", 1.3),
        ("min_new_tokens", 4),
        ("logit_bias", {"5": 3.0}),
        ("regex", "a+"),
        ("json_schema", "{}"),
        ("ebnf", "root ::= 'a'"),
    ],
)
def test_sampling_the_speculative_verify_does_not_apply_is_refused(field, value):
    """The NextN worker's verify applies temperature / top_k / top_p / min_p only: anything else
    would be silently ignored under speculation, so it is refused naming the field."""
    obj = req(sampling_params={field: value, "temperature": 0.7})
    with pytest.raises(
        G.RequestRejected, match=rf"sampling_params\.{field} = .*not supported with --speculative-algorithm EAGLE"
    ):
        G.check_request(obj, [1, 2], vocab_size=V, dsv4=True, speculative="EAGLE")
    G.check_request(obj, [1, 2], vocab_size=V, dsv4=True, speculative=None)  # served without speculation
    G.check_request(obj, [1, 2], vocab_size=V, dsv4=False, speculative="EAGLE")  # not our model


def test_speculation_refuses_logprobs_and_keeps_plain_sampling():
    with pytest.raises(G.RequestRejected, match="return_logprob .*--speculative-algorithm EAGLE"):
        G.check_request(req(return_logprob=True), [1, 2], vocab_size=V, dsv4=True, speculative="EAGLE")
    plain = req(
        sampling_params={
            "temperature": 0.8,
            "top_p": 0.9,
            "top_k": 20,
            "min_p": 0.05,
            "n": 4,
            "frequency_penalty": 0.0,
            "repetition_penalty": 1.0,
            "regex": None,
            "logit_bias": None,
            "max_new_tokens": 8,
        }
    )
    G.check_request(plain, [1, 2], vocab_size=V, dsv4=True, speculative="EAGLE")


def test_body_limit_default_follows_the_context(monkeypatch):
    monkeypatch.delenv(settings.MAX_REQUEST_BYTES.name, raising=False)
    assert G.max_body_bytes(None) == G.MIN_BODY_BYTES
    assert G.max_body_bytes(1 << 20) == 32 << 20
    monkeypatch.setenv(settings.MAX_REQUEST_BYTES.name, "1000")
    assert G.max_body_bytes(1 << 20) == 1000


@pytest.fixture
def client(monkeypatch):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route
    from starlette.testclient import TestClient

    seen = []

    async def echo(request):
        body = await request.body()
        seen.append(len(body))
        return JSONResponse({"n": len(body)})

    monkeypatch.setenv(settings.MAX_REQUEST_BYTES.name, "1000")
    app = Starlette(routes=[Route("/generate", echo, methods=["POST", "GET"])])
    app.add_middleware(G.RequestGate)
    return TestClient(app), seen


def test_body_limit_middleware(client):
    c, seen = client
    assert c.post("/generate", content=b"x" * 1000).json() == {"n": 1000}
    r = c.post("/generate", content=b"x" * 1001)
    assert r.status_code == 413 and "1001 bytes exceeds the limit of 1000" in r.json()["message"]
    assert seen == [1000]  # the route never ran for the refused body

    def chunks():  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b"y" * 400

    r = c.post("/generate", content=chunks())
    assert r.status_code == 413 and "SGLANG_DSV4_MAX_REQUEST_BYTES" in r.json()["message"]
    assert c.get("/generate").status_code == 200  # bodiless methods pass
    assert seen == [1000, 0]


# ------------------------------------------------------------------------------------------------
# Numeric sampling fields: what SGLang's own checks let through but its scheduler cannot hold.


def sampling_ok(params, ctx=None):
    return G.check_sampling(params, vocab_size=V, context_len=ctx)


def sampling_refused(params, match, ctx=None):
    with pytest.raises(G.RequestRejected, match=match):
        G.check_sampling(params, vocab_size=V, context_len=ctx)


def test_n_must_be_a_positive_integer():
    for n in (1, 2, settings.MAX_N.default):
        sampling_ok({"n": n})
    for n in (0, -1, None, 1.5, True, "2"):
        sampling_refused({"n": n}, r"n = .*: expected an integer in \[1, 64\]")


def test_n_is_checked_before_sglang_expands_the_request():
    """`n: 0` reached a range() step inside SGLang's normalization ("range() arg 3 must not be
    zero"); the hook refuses it, naming n, before the original runs."""
    ran = []
    for params in ({"n": 0}, [{"n": 0}, {"n": 0}], {"n": settings.MAX_N.default + 1}):
        obj = SimpleNamespace(input_embeds=None, sampling_params=params)
        with pytest.raises(G.RequestRejected, match=r"^n = "):
            normalize_hook(lambda self: ran.append(self), obj)
    assert ran == []
    normalize_hook(lambda self: ran.append(self), SimpleNamespace(input_embeds=None, sampling_params={"n": 2}))
    normalize_hook(lambda self: ran.append(self), SimpleNamespace(input_embeds=None, sampling_params=None))
    assert len(ran) == 2


def test_temperature_must_fit_float32():
    """1e39 is finite for SGLang's check but inf in the sampler's float32 tensor (the speculative
    accept step raised on it in the scheduler)."""
    for t in (0, 0.0, 1e-30, 0.7, 2, 3.4e38, G.FLOAT32_MAX):
        assert sampling_ok({"temperature": t}) == {"temperature": t}
    for t in (3.5e38, 1e39, 1e308, 10**39, 10**400, float("inf"), float("nan"), -1, -1e-9, float("-inf")):
        sampling_refused({"temperature": t}, r"temperature = .*: expected a number in \[0, 3\.4028235e\+38\]")
    sampling_ok({"temperature": None})  # SGLang's default


def test_top_k_range_and_clamp():
    """-1 or [1, vocab] as asked; above the vocabulary (also past int32, which crashed SGLang's
    sampler) served as -1, every token, which is what such a top_k means; 0 refused whatever the
    temperature, so every route answers it alike."""
    for k in (-1, 1, 2, V):
        params = {"top_k": k, "temperature": 0.7}
        assert sampling_ok(params) is params
    for k in (V + 1, 1 << 30, 2**31 - 1, 2**31, 10**12, 2**63, 10**400):
        params = {"top_k": k, "temperature": 0.7}
        assert sampling_ok(params) == {"top_k": -1, "temperature": 0.7}
        assert params["top_k"] == k  # the client's dict is left alone
    for k in (0, -2, -(2**31), 1.5, 5.0, True, "5"):
        sampling_refused({"top_k": k}, rf"top_k = .*: expected -1 \(every token\) or an integer in \[1, {V}\]")
    sampling_refused({"top_k": 0, "temperature": 0}, "top_k = 0")  # SGLang let this one through
    ok_params = {"top_k": None}
    assert sampling_ok(ok_params) is ok_params


def test_check_request_serves_the_clamped_top_k():
    obj = req(sampling_params={"top_k": 2**31, "max_new_tokens": 3})
    ok(obj, [1, 2])
    assert obj.sampling_params == {"top_k": -1, "max_new_tokens": 3}


def test_min_new_tokens_is_bounded_by_the_context():
    """With max_new_tokens null SGLang bounds min_new_tokens by nothing, and its penalizer holds
    it in an int32 tensor."""
    sampling_ok({"min_new_tokens": 4096}, ctx=4096)
    sampling_refused({"min_new_tokens": 4097}, r"min_new_tokens = 4097: expected an integer in \[0, 4096\]", ctx=4096)
    sampling_ok({"min_new_tokens": 2**31 - 1})
    sampling_refused({"min_new_tokens": 2**31, "max_new_tokens": None}, r"min_new_tokens = .*\[0, 2147483647\]")


def test_logit_bias_values_in_the_documented_range():
    sampling_ok({"logit_bias": {"5": 100, "6": -100.0, "7": 0.5}})
    for b in (100.5, -101, 1e39, 10**400, float("nan"), float("-inf")):
        sampling_refused(
            {"logit_bias": {"5": 1.0, "9": b}}, r"logit_bias\['9'\] = .*: expected a number in \[-100, 100\]"
        )


def test_stream_interval_and_stop_token_ids():
    for every in (None, 0, 1, 2**31 - 1):
        sampling_ok({"stream_interval": every})
    for every in (-1, 2**31, 2**64 + 1, 1.5):
        sampling_refused({"stream_interval": every}, r"stream_interval = .*: expected an integer in \[0, 2147483647\]")
    sampling_ok({"stop_token_ids": [0, V - 1]})
    sampling_ok({"stop_token_ids": None})
    for bad in (V, -1, 2**64, 1.0):
        sampling_refused({"stop_token_ids": [3, bad]}, rf"stop_token_ids: .* is not a token id in \[0, {V}\)")


def test_plain_valid_sampling_passes_unchanged():
    params = {
        "temperature": 0.8,
        "top_p": 0.9,
        "top_k": 20,
        "min_p": 0.05,
        "n": 4,
        "max_new_tokens": 8,
        "min_new_tokens": 2,
        "frequency_penalty": 0.5,
        "presence_penalty": -0.5,
        "repetition_penalty": 1.2,
        "logit_bias": {"3": -100},
        "stream_interval": 2,
        "stop_token_ids": [1],
        "sampling_seed": 7,
    }
    assert sampling_ok(dict(params), ctx=4096) == params


def test_every_added_check_covers_a_value_sglangs_verify_accepts():
    """The checks above are the gaps: SGLang 0.5.23's SamplingParams.verify lets each of these
    through (and refuses what we leave to it)."""
    from sglang.srt.sampling.sampling_params import SamplingParams

    for kw in (
        {"temperature": 1e39},
        {"n": 0},
        {"min_new_tokens": 2**31, "max_new_tokens": None},
        {"logit_bias": {"3": 1e39}},
        {"stream_interval": 2**70},
        {"stop_token_ids": [2**64]},
        {"top_k": 0, "temperature": 0},
    ):
        SamplingParams(**kw).verify(V)
        with pytest.raises(G.RequestRejected):
            sampling_ok(kw)
    SamplingParams(top_k=2**31).verify(V)
    assert sampling_ok({"top_k": 2**31}) == {"top_k": -1}
    for kw in (
        {"top_p": 0.0},
        {"min_p": 1.5},
        {"frequency_penalty": 3},
        {"repetition_penalty": 0},
        {"max_new_tokens": -1},
        {"temperature": float("nan")},
    ):
        with pytest.raises(ValueError):
            SamplingParams(**kw).verify(V)


# ------------------------------------------------------------------------------------------------
# Bodies SGLang's parsing answers with a 500


def nested(depth: int, kind: str = "list") -> bytes:
    inner = b"1"
    for _ in range(depth):
        inner = b"[" + inner + b"]" if kind == "list" else b'{"a":' + inner + b"}"
    return inner


@pytest.mark.parametrize("kind", ["list", "dict"])
def test_deeply_nested_bodies_are_refused(kind):
    """A RecursionError in json (thousands of levels) or a 500 later (a few hundred) used to
    escape the gate; any depth past MAX_JSON_DEPTH is now a 400, on every route."""
    too_deep = rf"JSON nested deeper than {G.MAX_JSON_DEPTH} levels"
    for depth in (G.MAX_JSON_DEPTH, 300, 5000, 100_000):  # body depth = depth + 1 with the wrapper object
        body = b'{"text": "hi", "custom_params": ' + nested(depth, kind) + b"}"
        for path in ("/generate", "/v1/chat/completions", "/encode"):
            assert re.search(too_deep, G.shape_error(path, body) or ""), (path, depth)
    ok_body = b'{"text": "hi", "custom_params": ' + nested(G.MAX_JSON_DEPTH - 1, kind) + b"}"
    for path in ("/generate", "/v1/chat/completions", "/encode"):
        assert G.shape_error(path, ok_body) is None


def test_depth_check_leaves_flat_and_non_json_bodies_alone():
    batch = {"input_ids": [[1, 2, 3]] * 500, "sampling_params": {"max_new_tokens": 1}}  # many brackets, depth 3
    assert G.shape_error("/generate", json.dumps(batch).encode()) is None
    assert G.shape_error("/generate", b'{"text": "' + b"[" * 500 + b'"}') is None  # brackets inside a string
    assert G.shape_error("/v1/audio/transcriptions", b"\xff[[" * 200) is None  # not JSON: SGLang's to answer


def test_gate_answers_deep_bodies_400(client):
    c, seen = client
    r = c.post("/generate", content=nested(400))
    assert r.status_code == 400 and "nested deeper" in r.json()["message"]
    r = c.post("/generate", content=b'{"text": ' + nested(100_000, "dict")[:900] + b"}")  # truncated: not JSON
    assert r.status_code == 200  # left to the route (SGLang answers invalid JSON with 400)
    assert seen == [len(b'{"text": ') + 900 + 1]


# ------------------------------------------------------------------------------------------------
# Streamed /generate refusals: a 4xx before the stream starts, through SGLang's own route code


class FakeTokenizerManager:
    """What `http_server.serve_generate_request` reads of the tokenizer manager: `generate_request`
    (validation runs inside it, so a refusal is raised on the first pull) and the abort task."""

    def __init__(self, refusal=None, outputs=()):
        self.refusal, self.outputs, self.aborted = refusal, list(outputs), []

    async def generate_request(self, obj, request):
        if self.refusal:
            raise G.RequestRejected(self.refusal)
        for out in self.outputs:
            yield out

    def create_abort_task(self, obj):
        from starlette.background import BackgroundTask

        async def abort():
            self.aborted.append(obj)

        return BackgroundTask(abort)


class FakeRequest:
    headers = {}

    async def is_disconnected(self):
        return False


async def body_of(response):
    return b"".join([c if isinstance(c, bytes) else c.encode() async for c in response.body_iterator])


@pytest.fixture(scope="module")
def http_server():
    from sglang.srt.entrypoints import http_server

    return http_server


def serve(http_server, monkeypatch, tm, stream=True, hook=True):
    import asyncio

    monkeypatch.setattr(http_server, "_global_state", SimpleNamespace(tokenizer_manager=tm))
    obj = SimpleNamespace(stream=stream, rid="r1")
    orig = http_server.serve_generate_request

    async def run():
        response = await (stream_refusals_hook(orig, obj, FakeRequest()) if hook else orig(obj, FakeRequest()))
        body = await body_of(response) if hasattr(response, "body_iterator") else response.body
        if response.background is not None:
            await response.background()
        return response, body

    return asyncio.run(run())


def test_streamed_refusal_answers_400_before_the_stream(http_server, monkeypatch):
    msg = "sampling_params.frequency_penalty = 0.5: not supported with --speculative-algorithm DSPARK"
    # without the hook (stock SGLang): a 200 whose only event is the error
    response, body = serve(http_server, monkeypatch, FakeTokenizerManager(refusal=msg), hook=False)
    assert response.status_code == 200 and b'"error"' in body and msg.encode() in body
    tm = FakeTokenizerManager(refusal=msg)
    response, body = serve(http_server, monkeypatch, tm)
    assert response.status_code == 400 and response.media_type == "application/json"
    error = json.loads(body)["error"]
    assert error["message"] == msg and error["code"] == 400
    assert len(tm.aborted) == 1  # SGLang's clean-up of the request still runs


def test_streams_that_pass_validation_are_unchanged(http_server, monkeypatch):
    outs = [{"text": "a", "meta_info": {"id": "r1"}}, {"text": "ab", "meta_info": {"id": "r1", "finish_reason": None}}]
    _, want = serve(http_server, monkeypatch, FakeTokenizerManager(outputs=outs), hook=False)
    response, got = serve(http_server, monkeypatch, FakeTokenizerManager(outputs=outs))
    assert response.status_code == 200 and got == want and got.endswith(b"data: [DONE]\n\n")
    assert got.count(b"data: ") == 3
    # an output whose text merely mentions an error is not a refusal
    outs = [{"text": '{"error": 1}', "meta_info": {}}]
    response, _ = serve(http_server, monkeypatch, FakeTokenizerManager(outputs=outs))
    assert response.status_code == 200
    # non-streamed requests are the original's business
    response, body = serve(http_server, monkeypatch, FakeTokenizerManager(refusal="x"), stream=False)
    assert response.status_code == 400 and json.loads(body) == {"error": {"message": "x"}}


def test_stream_hook_is_registered_against_sglangs_signature(http_server):
    from sglang_dsv4_ascend.integration.hooks import HOOKS

    hook = next(h for h in HOOKS if h.name == "generate_stream_refusals")
    hook.check()
