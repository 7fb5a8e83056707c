"""`python -m sglang_dsv4_ascend.bench serve` against one real SGLang server with
`--speculative-algorithm dspark` on the shipped trained tiny DeepSeek-V4: the numbers it reports are checked
against what the server itself says for the same requests made without streaming (greedy, so the
same tokens and the same verify rounds): token counts against `usage`, accept length and the
per-position acceptance against `sglext.spec_tokens_details`. The chunk parser and the argument
errors are checked without a server."""

import contextlib
import io
import json
import sys

import pytest
import requests

from sglang_dsv4_ascend.bench import headline, serve
from sglang_dsv4_ascend.data import load_prompts
from sglang_dsv4_ascend.tools.server import free_port

N_PROMPTS, MAX_TOKENS, LEVELS = 4, 24, (1, 4)


# -- without a server -----------------------------------------------------------------------------


def test_chunk_parser_counts_only_token_chunks():
    usage_only = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 7}}
    empty_delta = {"choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]}
    role_only = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}], "usage": None}
    stats_only = {
        "choices": [{"index": 0, "delta": {"content": None}}],
        "usage": {"completion_tokens": 9},
        "sglext": {"spec_tokens_details": {"spec_verify_ct": 3}},
    }
    three = {"choices": [{"index": 0, "delta": {"content": "abc"}}], "usage": {"completion_tokens": 5}}
    assert serve.chunk_tokens(usage_only, 4) == 0
    assert serve.chunk_tokens(empty_delta, 4) == 0
    assert serve.chunk_tokens(role_only, 0) == 0
    assert serve.chunk_tokens(stats_only, 4) == 0
    assert serve.chunk_tokens(three, 2) == 3


def test_acceptance_per_position():
    # 4 rounds: 2 with 0 correct drafts, 1 with 1, 1 with 2 (block of 3)
    assert serve.acceptance([2, 1, 1], 3) == [0.5, 0.5, 0.0]
    assert serve.acceptance([5], 3) == [0.0, None, None]  # no round reached position 1


def _run(argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = serve.main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--concurrency", "0"], "--concurrency"),
        (["--concurrency", ""], "--concurrency"),
        (["--concurrency", "1,x"], "--concurrency"),
        (["--num-prompts", "-3"], "--num-prompts"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--timeout", "0"], "--timeout"),
        (["--temperature", "-1"], "--temperature"),
        (["--dataset", "/nonexistent/prompts.jsonl"], "--dataset"),
        ([], "--url"),  # a port nobody listens on
    ],
)
def test_bad_flags_exit_2_naming_the_flag(args, flag):
    url = [] if flag == "--url" and not args else ["--url", f"http://127.0.0.1:{free_port()}"]
    rc, out, err = _run(url + args)
    assert rc == 2 and flag in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and not out, err


def test_missing_url_and_missing_matplotlib(monkeypatch):
    rc, _, err = _run(["--concurrency", "1"])
    assert rc == 2 and "--url" in err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, _, err = _run(["--url", f"http://127.0.0.1:{free_port()}", "--plot", "/tmp/x"])
    assert rc == 2 and "--plot" in err and "matplotlib" in err, err


# -- one real server --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(server_pool):
    # the shipped trained model: its drafts are accepted, so the per-position figures are non-trivial
    # (the headline's DSpark adaptive server, shared with test_trained_tiny.py)
    path, env, flags = headline.METHODS["dspark_adaptive"]
    return server_pool.get(path, *headline.POOL, *flags, env=env)


@pytest.fixture(scope="module")
def report(server, tmp_path_factory):
    path = tmp_path_factory.mktemp("bench_out") / "serve.json"
    rc, out, err = _run(
        [
            "--url",
            server.url,
            "--out",
            str(path),
            "--concurrency",
            ",".join(map(str, LEVELS)),
            "--num-prompts",
            str(N_PROMPTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--per-request",
        ]
    )
    assert rc == 0, f"{err[-3000:]}\n{server.log_tail(60)}"
    rep = json.loads(path.read_text())
    assert json.loads(out) == rep  # stdout carries the same JSON
    return rep


def _chat(server, model, prompt, max_tokens):
    body = {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": False,
        "return_spec_tokens_details": True,
    }
    r = requests.post(f"{server.url}/v1/chat/completions", json=body, timeout=300)
    r.raise_for_status()
    return r.json()


@pytest.fixture(scope="module")
def reference(server, report):
    """The server's own figures: each prompt once, not streamed, greedy."""
    model = report["config"]["model"]
    return [_chat(server, model, p, MAX_TOKENS) for p in load_prompts("humaneval", N_PROMPTS, max_chars=None)]


def test_levels(report):
    assert report["bench"] == "serve" and [lv["concurrency"] for lv in report["levels"]] == list(LEVELS)
    assert len(report["requests"]) == N_PROMPTS * len(LEVELS)
    for lv in report["levels"]:
        assert lv["requests"] == N_PROMPTS and lv["errors"] == 0 and lv["first_error"] is None, lv
        for key in ("ttft_ms", "tpot_ms", "itl_ms"):
            assert lv[key]["p50"] > 0 and lv[key]["mean"] > 0, (key, lv)
            assert lv[key]["p50"] <= lv[key]["p90"] <= lv[key]["p99"], (key, lv)
        assert lv["output_tok_per_s"] > 0 and lv["request_per_s"] > 0 and lv["duration_s"] > 0
        acc = lv["acceptance_per_position"]
        assert acc and acc[0] is not None and all(0 <= p <= 1 for p in acc if p is not None), acc
        assert lv["accept_length_mean"] >= 1
        reqs = [r for r in report["requests"] if r["concurrency"] == lv["concurrency"]]
        assert lv["total_output_tokens"] == sum(r["output_tokens"] for r in reqs)
        assert lv["token_counts_match_usage"] == all(r["tokens_without_chunk"] == 0 for r in reqs)


def test_token_counts_are_the_servers(server, report, reference):
    model = report["config"]["model"]
    prompts = load_prompts("humaneval", N_PROMPTS, max_chars=None)
    for r in report["requests"]:
        ref = reference[r["prompt_index"]]
        want = ref["usage"]["completion_tokens"]
        # the stream's own usage chunk, and the same request made non-streamed, agree
        assert r["usage_completion_tokens"] == want and r["usage_prompt_tokens"] == ref["usage"]["prompt_tokens"], r
        assert sum(r["chunk_tokens"]) == r["output_tokens"] and all(n > 0 for n in r["chunk_tokens"])
        assert r["chunk_ms"] == sorted(r["chunk_ms"]) and r["ttft_ms"] <= r["chunk_ms"][0] + 1e-3
        if r["output_tokens"] != want:
            # SGLang's chat stream sends no chunk for a step that adds no text: the server, stopped
            # after the tokens the bench counted, must already have produced the whole text
            short = _chat(server, model, prompts[r["prompt_index"]], r["output_tokens"])
            assert short["usage"]["completion_tokens"] == r["output_tokens"], (r, short)
            assert short["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"], r
            assert r["tokens_without_chunk"] == want - r["output_tokens"] > 0
    # most requests' tokens all come with text; the counts are exact, not just bounded
    assert sum(r["tokens_without_chunk"] == 0 for r in report["requests"]) >= len(report["requests"]) // 2


def _p(hist, j):
    reached = sum(hist[j - 1 :])
    return sum(hist[j:]) / reached if reached else None


def test_accept_length_is_the_servers(report, reference):
    # each request's figures against the server's own counters for that request (its last chunk's
    # sglext): a separate reference run of the same prompt need not draft the same rounds, since
    # adaptive verify plans from a cost surface refined online from the server's timings
    solo = [r for r in report["requests"] if r["concurrency"] == 1]
    assert len(solo) == N_PROMPTS
    for r in solo:
        assert reference[r["prompt_index"]]["sglext"]["spec_tokens_details"]["spec_verify_ct"] > 0
        server_d = r["spec"]
        assert server_d["spec_verify_ct"] > 0
        hist = server_d["spec_correct_drafts_histogram"]
        assert sum(hist) == server_d["spec_verify_ct"]
        # accepted drafts + the bonus per round, from the round histogram
        want = 1 + sum(k * v for k, v in enumerate(hist)) / sum(hist)
        assert r["accept_length"] == pytest.approx(want) == pytest.approx(server_d["spec_accept_length"]), server_d
        acc = r["acceptance_per_position"]  # one per draft position the server's histogram has
        # adaptive verify: a request whose rounds were all cut to k drafts has k + 1 bins, fewer
        # than the block's positions (seen in CI: 2 of 4)
        assert len(acc) == len(hist) - 1 <= server_d["spec_num_proposed_drafts"] // server_d["spec_verify_ct"]
        assert acc == [None if _p(hist, j) is None else round(_p(hist, j), 4) for j in range(1, len(acc) + 1)]
    for r in report["requests"]:
        assert r["accept_length"] >= 1 and r["cached_tokens"] is not None
