"""`--speculative-algorithm dspark` through real SGLang servers on the tiny DeepSeek-V4 (fp32,
checkpoint-native block size 4): greedy output equals serving without speculation token for
token with static and adaptive verify, gamma native and not (6), single and 8 concurrent
requests, prompts crossing the 16-token window, 4-token blocks and the 128-token block boundary;
with the real DSpark draft (random weights) and with the replay drafter at full, partial and zero
acceptance, whose known pattern the reported per-request stats must reproduce in every stream
chunk."""

import json
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from spec_prompts import EXACT_ROUNDS, replay_drafter, spec_prompts

from sglang_dsv4_ascend import settings

pytestmark = pytest.mark.e2e

N_NEW = 24
POOL = ("--max-total-tokens", "32768")


def dspark_server(servers, ckpt, mode, *args, env=None):
    return servers.get(
        ckpt, *POOL, "--speculative-algorithm", "dspark", *args, env={settings.DSPARK_VERIFY.name: mode, **(env or {})}
    )


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("flash", "dspark")


@pytest.fixture(scope="module")
def prompts(ckpt):
    return spec_prompts(ckpt, 207)


@pytest.fixture(scope="module")
def reference(server_pool, ckpt, prompts):
    # the no-speculation server is shared (test_parallel_serving.py's one-rank reference uses it)
    srv = server_pool.get(ckpt, *POOL)
    return [srv.generate(p, N_NEW, ignore_eos=True)["output_ids"] for p in prompts]


def _concurrent(srv, prompts, **kw):
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: srv.generate(p, N_NEW, ignore_eos=True, **kw), prompts))


# A round cost surface (SGLang's SpsAdditiveCostTable fields plus our draft term) under which
# drafting pays for one request and not for more: a batch of several skips drafting (plain decode
# steps, every 32nd drafting anyway), a lone request drafts. Its seconds are made up, as the replay
# drafter's acceptance is, to drive the decision on purpose; the server's online refinement drops
# rounds this far off the surface until most recent rounds are (the surface is then replaced), so
# the first rounds of a batch skip drafting.
SKIP_TABLE = {
    "bias_seconds": 0.01,
    "bs_probes": [1, 2],
    "alpha_seconds": [0.0, 1.0],
    "m_probes": [1, 64],
    "theta_seconds": [0.0, 0.0],
    "draft_seconds": [0.0, 1.0],
}


@pytest.mark.parametrize("mode,gamma", [("static", None), ("adaptive", None), ("adaptive", "6")])
def test_greedy_dspark_equals_no_speculation(servers, ckpt, prompts, reference, mode, gamma, tmp_path_factory):
    args = ("--speculative-dspark-block-size", gamma) if gamma else ()
    if gamma:  # gamma 6 also plans with a cost file that makes batches skip drafting
        table = tmp_path_factory.getbasetemp() / "skip_table.json"
        table.write_text(json.dumps(SKIP_TABLE))
        args += ("--speculative-dspark-sps-table-path", str(table))
    srv = dspark_server(servers, ckpt, mode, *args)
    log = srv.log_text()
    want_gamma = gamma or "4"
    assert f"DSpark worker: gamma={want_gamma} (checkpoint native 4), verify={mode}" in log
    if mode == "adaptive":
        assert f"round cost model ({table if gamma else 'measured at startup'}" in log
    out = srv.generate(prompts[0], N_NEW, ignore_eos=True)
    assert out["output_ids"] == reference[0]
    m = out["meta_info"]
    assert m["spec_verify_ct"] > 0 and m["spec_num_proposed_drafts"] == m["spec_verify_ct"] * int(want_gamma)
    assert sum(m["spec_cap_lens_histogram"]) == m["spec_verify_ct"]
    if mode == "static":
        # a round verifies the whole block (+ the anchor row) or, where the guard measured plain
        # steps faster (random weights accept almost nothing), the anchor row alone
        h = m["spec_cap_lens_histogram"]
        assert len(h) == int(want_gamma) + 2 and h[1] + h[-1] == m["spec_verify_ct"], h
        rec = srv.server_info()["internal_states"][0]["dspark_info_record"]
        assert rec["rounds_by_guard"]["learning drafting"] >= 4, rec["rounds_by_guard"]
        # drafting that accepts almost nothing is never a sure win over a plain step
        assert all(c.get("drafting_over_plain", 0) < 1.25 for c in rec["guard_by_batch"].values()), rec
    before = srv.server_info()["internal_states"][0]["dspark_info_record"]
    outs = _concurrent(srv, prompts)
    assert [o["output_ids"] for o in outs] == reference
    if gamma:  # lossless with both kinds of rounds: the lone request drafted, the batch mostly not
        rec = srv.server_info()["internal_states"][0]["dspark_info_record"]
        drafted = before["rounds"] - before["skipped_draft_rounds"]
        assert drafted > 0 and rec["skipped_draft_rounds"] - before["skipped_draft_rounds"] > 0, (before, rec)
        assert rec["round_ms_by_batch"]["1"]["predicted_ms"] > 0


def _stream(srv, prompt):
    """Every chunk of a streamed /generate (native API)."""
    r = requests.post(
        f"{srv.url}/generate",
        json={
            "input_ids": prompt,
            "stream": True,
            "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True},
        },
        stream=True,
        timeout=300,
    )
    r.raise_for_status()
    chunks = []
    for line in r.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            chunks.append(json.loads(line[6:]))
    return chunks


def _openai_stream(srv, prompt, details: bool):
    body = {
        "model": srv.model_path,
        "prompt": prompt,
        "max_tokens": N_NEW,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    if details:
        body["return_spec_tokens_details"] = True
    r = requests.post(f"{srv.url}/v1/completions", json=body, stream=True, timeout=300)
    r.raise_for_status()
    return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith(b"data: ") and line != b"data: [DONE]"]


@pytest.mark.parametrize("mode", ["static", "adaptive"])
def test_replay_acceptance_and_stats(servers, ckpt, prompts, reference, tmp_path, mode):
    """Full / partial / zero acceptance on purpose; the stats the server reports are recomputed
    from the known pattern. Static: full accepts all 4 drafts per round, partial:2 two, zero none.
    Adaptive: the replay's confidences (0.9 where right, 0.2 after) let the planner trim, so
    zero rounds verify fewer rows, and how far it trims a right draft depends on the round cost
    surface it measured (timing: a loaded machine trimmed full rounds to 3), so there no round
    accepts past its first wrong draft, and the output never changes."""
    modes = ["full", "partial:2", "zero", "full", "partial:1", "zero", "full", "partial:3"]
    env = {settings.TEST_DRAFTER.name: replay_drafter(tmp_path, prompts, reference, modes), **EXACT_ROUNDS}
    gamma = 4
    srv = dspark_server(servers, ckpt, mode, env=env)
    outs = _concurrent(srv, prompts)
    assert [o["output_ids"] for o in outs] == reference
    for out, m in zip(outs, modes):
        meta = out["meta_info"]
        correct = {"full": gamma, "zero": 0}.get(m) if not m.startswith("partial") else int(m.split(":")[1])
        hist = meta["spec_correct_drafts_histogram"]
        rounds = meta["spec_verify_ct"]
        assert meta["spec_num_correct_drafts"] == sum(k * v for k, v in enumerate(hist))
        assert sum(hist) == rounds and not any(hist[correct + 1 :]), (m, hist)  # never past a wrong draft
        if mode == "static":
            # every round but possibly the last (cut by max_new_tokens) accepts exactly `correct`
            assert hist[correct] >= rounds - 1, (m, hist)
            assert meta["spec_cap_lens_histogram"][gamma + 1] == rounds
        elif m == "zero":  # the planner verifies what the confidences deserve, not the whole block
            assert meta["spec_cap_length"] < gamma + 1
    # streaming: every chunk carries the stats so far, consistent with the tokens so far
    chunks = _stream(srv, prompts[1])
    assert len(chunks) > 2
    prev = 0
    for i, ch in enumerate(chunks):
        meta = ch["meta_info"]
        n = meta["completion_tokens"]
        assert n >= prev
        prev = n
        if i:  # every chunk after the prefill's token carries the counters so far
            hist = meta["spec_correct_drafts_histogram"]
            assert sum(hist) == meta["spec_verify_ct"]
            # the first token comes from the prefill, each round emits accepted + 1; the last
            # round may be cut by max_new_tokens
            emitted = 1 + sum((k + 1) * v for k, v in enumerate(hist))
            assert n == emitted if i < len(chunks) - 1 else n <= emitted, (i, n, hist)
    assert chunks[-1]["meta_info"]["completion_tokens"] == N_NEW
    # OpenAI stream: the stats ride in every token chunk with return_spec_tokens_details, and the
    # flag adds no chunk of its own. Where a round's tokens are cut into chunks depends on timing
    # (a busy client or detokenizer coalesces rounds: seen under load, ' brown' + ' now' in one
    # run and ' brown now' in the other), so the streams are compared by their text and by the
    # chunks without a token, not chunk by chunk.
    plain, withstats = _openai_stream(srv, prompts[2], False), _openai_stream(srv, prompts[2], True)

    def text(cs):
        return "".join(c["choices"][0].get("text") or "" for c in cs if c.get("choices"))

    assert text(plain) == text(withstats)
    # a chunk without text (a round whose bytes end mid-character) is one the plain stream has
    # too: it carries a round of its own, never a repeat of the previous chunk's counters (how many
    # there are depends on how rounds coalesce, so counts are not compared across the two runs)
    ct = [
        c["sglext"]["spec_tokens_details"]["spec_verify_ct"]
        for c in withstats
        if c.get("choices") and c["choices"][0].get("finish_reason") is None and c.get("sglext")
    ]
    assert all(b > a for a, b in zip(ct, ct[1:])), ct
    # nothing after the finishing chunk carries a choice (SGLang's own sglext-only chunk follows it)
    end = next(i for i, c in enumerate(withstats) if c.get("choices") and c["choices"][0].get("finish_reason"))
    assert not any(c.get("choices") for c in withstats[end + 1 :])
    assert not any((c.get("sglext") or {}).get("spec_tokens_details") for c in plain[:-2])
    rounds = 0
    token_chunks = [c for c in withstats if c.get("choices") and c["choices"][0].get("finish_reason") is None]
    assert len(token_chunks) > 2
    for c in token_chunks[1:]:  # the first one is the prefill's token: no round yet
        d = c["sglext"]["spec_tokens_details"]
        assert d["spec_verify_ct"] >= rounds and sum(d["spec_correct_drafts_histogram"]) == d["spec_verify_ct"]
        rounds = d["spec_verify_ct"]
        assert "cached_tokens" in c["sglext"]
    assert rounds > 0
    info = srv.server_info()
    rec = info["internal_states"][0]["dspark_info_record"]
    assert rec["rounds"] > 0 and set(rec["stage_ms_per_round"]) == {
        "draft",
        "plan",
        "verify",
        "accept",
        "commit",
        "extend",
    }


def test_replay_acceptance_under_captured_verify(servers, ckpt, prompts, reference, tmp_path):
    """Full / partial / zero acceptance on purpose while the speculative worker replays its captured
    target verify (--enable-torch-compile: buckets of 5 and 20 rows; dynamo's trace as the
    compiler, as in test_graph_serving.py): one request alone (the 5-row bucket, exact), then four
    together, whose batches of 2 and 3 as they start and finish are padded into the 20-row bucket.
    Each round accepts exactly what the replay dictates and the output equals no speculation:
    padding rows are never committed and never change a decision."""
    modes = ["full", "partial:2", "zero", "partial:1"]
    env = {
        **EXACT_ROUNDS,
        settings.TEST_DRAFTER.name: replay_drafter(tmp_path, prompts[:4], reference[:4], modes),
        settings.COMPILE_BACKEND.name: "eager",
    }
    graphs = ("--enable-torch-compile", "--cuda-graph-bs-decode", "1", "4")
    srv = dspark_server(servers, ckpt, "static", *graphs, env=env)
    alone = srv.generate(prompts[0], N_NEW, ignore_eos=True)
    outs = _concurrent(srv, prompts[:4])
    assert [o["output_ids"] for o in [alone] + outs] == reference[:1] + reference[:4]
    gamma = 4
    for out, m in zip([alone] + outs, modes[:1] + modes):
        meta = out["meta_info"]
        correct = gamma if m == "full" else 0 if m == "zero" else int(m.split(":")[1])
        hist, rounds = meta["spec_correct_drafts_histogram"], meta["spec_verify_ct"]
        # every round but possibly the last (cut by max_new_tokens) accepts exactly `correct`
        assert sum(hist) == rounds and hist[correct] >= rounds - 1 and not any(hist[correct + 1 :]), (m, hist)
    log = srv.log_text()
    for rows in (5, 20):
        assert f"verify of {rows} rows captured" in log, srv.log_tail(80)
        assert f"first replay of the captured verify, {rows} rows" in log, srv.log_tail(80)


def test_stats_hold_under_mixed_chunks(servers, ckpt, prompts, reference, tmp_path):
    """--enable-mixed-chunk with 128-token prefill chunks: while later prompts prefill, the running
    requests ride along each chunk as plain one-token decodes (SGLang's mixed step), tokens no
    verify round committed. A request's accept length counts its rounds' tokens only
    (1 + correct drafts / rounds), at most the block + 1, where SGLang's completion tokens / rounds
    went above it (8.7-9.8 for block 4 was reported). Every request
    carries its counters, in every chunk, a request with no round too (at zero), and the output is
    the no-speculation output. Two of the first requests accept nothing, so they decode for
    N_NEW - 1 rounds and are still running whenever the later prompts arrive (full-accept ones
    alone could finish first on a loaded machine), and each mixed token shows in their round
    count."""
    gamma, short, late = 4, [0, 1, 2, 3], [4, 5, 6]  # 40-token prompts; then 110, 124 and 193 tokens
    modes = ["full", "full", "zero", "zero"] + ["partial:2"] * 3 + ["zero"]
    per_round = {"full": gamma + 1, "partial:2": 3, "zero": 1}  # tokens a round commits
    env = {settings.TEST_DRAFTER.name: replay_drafter(tmp_path, prompts, reference, modes), **EXACT_ROUNDS}
    srv = dspark_server(
        servers,
        ckpt,
        "static",
        "--chunked-prefill-size",
        "128",
        "--enable-mixed-chunk",
        "--disable-radix-cache",
        env=env,
    )
    started = [threading.Event() for _ in short]
    chunks = {}

    def stream(k):
        chunks[k] = []
        r = requests.post(
            f"{srv.url}/generate",
            json={
                "input_ids": prompts[k],
                "stream": True,
                "sampling_params": {"max_new_tokens": N_NEW, "temperature": 0, "ignore_eos": True},
            },
            stream=True,
            timeout=300,
        )
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks[k].append(json.loads(line[6:]))
                started[k].set()

    with ThreadPoolExecutor(len(short) + len(late) + 1) as ex:
        streams = [ex.submit(stream, k) for k in short]
        assert all(e.wait(120) for e in started), "the first requests never started decoding"
        # the later prompts prefill in chunks while the first ones decode
        later = [ex.submit(srv.generate, prompts[k], N_NEW, ignore_eos=True) for k in late]
        one = ex.submit(srv.generate, prompts[7], 1)
        for f in streams:
            f.result()
        outs = {k: chunks[k][-1] for k in short} | {k: f.result() for k, f in zip(late, later)}
        one = one.result()
    assert re.search(r"Prefill batch.*#running-req: [1-9]", srv.log_since()), "no mixed step ran"
    assert {k: o["output_ids"] for k, o in outs.items()} == {k: reference[k] for k in outs}
    for k in short:  # (a native stream's chunks carry the output so far)
        assert all("spec_verify_ct" in c["meta_info"] for c in chunks[k])  # the prefill's chunk too
    mixed = 0
    for k, out in outs.items():
        m = out["meta_info"]
        hist, rounds = m["spec_correct_drafts_histogram"], m["spec_verify_ct"]
        assert sum(hist) == rounds > 0, (k, m)
        assert m["spec_accept_length"] == pytest.approx(1 + m["spec_num_correct_drafts"] / rounds), (k, m)
        assert 1 <= m["spec_accept_length"] <= gamma + 1, (k, m)
        # every round but possibly the last (the replayed reference ends at N_NEW) accepts its mode's
        assert hist[per_round[modes[k]] - 1] >= rounds - 1, (k, hist)
        if modes[k] == "zero":  # SGLang's completion tokens / rounds is above 1 once a step mixed
            assert m["spec_accept_length"] == 1.0, (k, m)
        # fewer rounds than N_NEW - 1 tokens need at the mode's rate: some came from mixed steps
        mixed += rounds < -(-(N_NEW - 1) // per_round[modes[k]])
    assert mixed, "no running request decoded a token in a mixed step"
    m = one["meta_info"]
    assert len(one["output_ids"]) == 1 and m["spec_verify_ct"] == 0 and m["spec_accept_length"] == 0.0
