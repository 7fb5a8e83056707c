"""Request validation at the boundary (request_guard): each check refuses exactly the requests
outside its range, names the field, and leaves valid requests alone; the body-size middleware
refuses oversized bodies before the route reads them, with or without a Content-Length."""

from types import SimpleNamespace

import pytest

from sglang_dsv4_ascend import request_guard as G

V = 1024


def req(**kw):
    base = dict(text=None, input_ids=None, input_embeds=None, return_logprob=False, top_logprobs_num=None,
                logprob_start_len=None, sampling_params={})
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
    ok(req(sampling_params={"n": G.DEFAULT_MAX_N}), [1])
    refused(req(sampling_params={"n": G.DEFAULT_MAX_N + 1}), [1], r"n = 65: at most 64 .*SGLANG_DSV4_MAX_N")
    monkeypatch.setenv(G.MAX_N_ENV, "2")
    refused(req(sampling_params={"n": 3}), [1], "at most 2")
    monkeypatch.setenv(G.MAX_N_ENV, "zero")
    with pytest.raises(ValueError, match="SGLANG_DSV4_MAX_N='zero': expected a positive integer"):
        ok(req(sampling_params={"n": 1}), [1])


def test_dsv4_only_refusals():
    embeds = [[0.0] * 7] * 3
    refused(req(input_embeds=embeds), None, "input_embeds: not supported by the DeepSeek-V4 model")
    ok(req(input_embeds=embeds), None, dsv4=False)  # other models use them
    refused(req(text="hi", input_ids=[1, 2]), [1, 2], "text and input_ids: give one prompt")
    ok(req(text="hi", input_ids=[1, 2]), [1, 2], dsv4=False)
    ok(req(text="hi"), [1, 2])


@pytest.mark.parametrize("field,value", [
    ("frequency_penalty", 0.5), ("presence_penalty", -0.2), ("repetition_penalty", 1.3), ("min_new_tokens", 4),
    ("logit_bias", {"5": 3.0}), ("regex", "a+"), ("json_schema", "{}"), ("ebnf", "root ::= 'a'"),
])
def test_sampling_the_speculative_verify_does_not_apply_is_refused(field, value):
    """The NextN worker's verify applies temperature / top_k / top_p / min_p only: anything else
    would be silently ignored under speculation, so it is refused naming the field."""
    obj = req(sampling_params={field: value, "temperature": 0.7})
    with pytest.raises(G.RequestRejected, match=rf"sampling_params\.{field} = .*not supported with --speculative-algorithm EAGLE"):
        G.check_request(obj, [1, 2], vocab_size=V, dsv4=True, speculative="EAGLE")
    G.check_request(obj, [1, 2], vocab_size=V, dsv4=True, speculative=None)  # served without speculation
    G.check_request(obj, [1, 2], vocab_size=V, dsv4=False, speculative="EAGLE")  # not our model


def test_speculation_refuses_logprobs_and_keeps_plain_sampling():
    with pytest.raises(G.RequestRejected, match="return_logprob .*--speculative-algorithm EAGLE"):
        G.check_request(req(return_logprob=True), [1, 2], vocab_size=V, dsv4=True, speculative="EAGLE")
    plain = req(sampling_params={"temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "n": 4,
                                 "frequency_penalty": 0.0, "repetition_penalty": 1.0, "regex": None,
                                 "logit_bias": None, "max_new_tokens": 8})
    G.check_request(plain, [1, 2], vocab_size=V, dsv4=True, speculative="EAGLE")


def test_body_limit_default_follows_the_context(monkeypatch):
    monkeypatch.delenv(G.MAX_BYTES_ENV, raising=False)
    assert G.max_body_bytes(None) == G.MIN_BODY_BYTES
    assert G.max_body_bytes(1 << 20) == 32 << 20
    monkeypatch.setenv(G.MAX_BYTES_ENV, "1000")
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

    monkeypatch.setenv(G.MAX_BYTES_ENV, "1000")
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
