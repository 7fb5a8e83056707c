"""Prefill/decode disaggregation of the shipped trained DeepSeek-V4 through SGLang's own PD path: a
prefill server and a decode server (`--disaggregation-mode`, NIXL over UCX on host memory) behind
SGLang's router (`sglang_router.launch_router --pd-disaggregation --mini-lb`), started by
tools/pd.py as a user's command starts them.

Greedy output through PD equals a unified server's (plain greedy decoding in process, which a
unified server's equals), token for token, without speculation and with
DSpark adaptive and NextN tree (topk 2) on both sides, alone and four at once, on chat prompts of
132-187 tokens (past the 16-token window, many C4 blocks, a C128 block closed and the next one
open when the state moves) and again when the prefill side's radix cache holds the prompt. The
drafts keep being accepted: the draft's state moves with the target's. That state is the draft's
(DSpark's rings, NextN's cache) whatever verifies its drafts, so NextN chain and DSpark static,
which move the same state as the tree and adaptive verify, have no pair of their own (they had one
each: ~55 s of CI for what these pairs already move). What each piece of the state is, and that
dropping one is caught, is tests/unit/test_pd_state.py. Faults: peers whose
layouts differ are refused at bootstrap naming both layouts; a decode side waiting for a prefill
side that never got the request times out naming the request and the prefill peer; the decode
server killed mid-transfer fails the request on the prefill side naming NIXL's disconnect; a
request whose decode side is gone times out on the prefill side naming the request and that no
decode peer claimed it. Each side frees its slots and keeps serving (SGLang stops the mismatched
decode server's scheduler with the refusal, as for any model)."""

import os
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prompts import chat_ids
from spec_prompts import accepted_per_drafting_round, spec_record

import sglang_dsv4_ascend as pkg
from sglang_dsv4_ascend.bench import headline
from sglang_dsv4_ascend.tools.pd import PDServers, post_json
from sglang_dsv4_ascend.tools.server import SGLangServer

pytestmark = pytest.mark.e2e

N_NEW = 32
POOL = headline.POOL
# DSpark's pair first: it stays up for the no-speculation pair's fault checks (a peer whose layout
# differs), which run last
METHODS = ("dspark_adaptive", "nextn_tree2", "nospec")
# well below what the same prompts accept unified (test_trained_tiny.py FLOORS)
FLOORS = {"dspark_adaptive": 0.8, "nextn_tree2": 1.0}
TIMEOUT_S = 8  # either side's wait for its peer (SGLang's defaults: 300 s)
CHUNKED = ("--chunked-prefill-size", "128")  # the prompts' state moves in two chunks


@pytest.fixture(scope="module")
def prompts():
    return chat_ids(4)


@pytest.fixture(scope="module")
def reference(prompts):
    """Plain greedy decoding in process: what a unified server gives for these prompts (checked
    equal when this test was written; test_graph_serving.py and test_indexcache_serving.py hold
    served output to it too), without starting one."""
    from sglang_dsv4_ascend.models.weights import load_model_from_dir
    from tests.oracles.decode import plain_greedy

    return plain_greedy(load_model_from_dir(pkg.TINY_MODEL_PATH), prompts, N_NEW)


@pytest.fixture(scope="module")
def pairs():
    """The pairs this module started, by method; every one stopped at the end."""
    started = {}
    yield started
    for pd in started.values():
        pd.stop()


def _pd(pairs, method, *args, env=None) -> PDServers:
    path, method_env, flags = headline.METHODS[method]
    pairs[method] = PDServers(path, *POOL, *flags, *args, env={**method_env, **(env or {})})
    return pairs[method].start()


@pytest.mark.parametrize("method", METHODS)
def test_pd_serves_like_a_unified_server(prompts, reference, pairs, method):
    # the no-speculation pair ends with the fault checks: its prefill side gives up on a decode
    # peer, and its decode side on a prefill peer, sooner than SGLang's defaults; it sends state
    # chunk by chunk
    quick = {f"SGLANG_DISAGGREGATION_{t}_TIMEOUT": str(TIMEOUT_S) for t in ("BOOTSTRAP", "WAITING")}
    pd = _pd(pairs, method, *CHUNKED, env=quick) if method == "nospec" else _pd(pairs, method)
    before = spec_record(pd.decode) if method in FLOORS else None
    single = pd.generate(prompts[0], N_NEW, ignore_eos=True)
    assert single.get("output_ids") == reference[0], (single, pd.prefill.log_tail(40), pd.decode.log_tail(40))
    with ThreadPoolExecutor(len(prompts)) as ex:
        outs = list(ex.map(lambda p: pd.generate(p, N_NEW, ignore_eos=True), prompts))
    assert [o.get("output_ids") for o in outs] == reference, [o.get("error") for o in outs]
    # the prefill side's radix cache holds prompts[0] now: a hit moves as state like a miss
    hit = pd.generate(prompts[0], N_NEW, ignore_eos=True)
    assert hit["meta_info"]["cached_tokens"] >= 128, hit["meta_info"]
    assert hit["output_ids"] == reference[0]
    if method in FLOORS:  # the draft resumed from the transferred state, so it keeps drafting well
        # (over the rounds that drafted: the guard's plain steps depend on this machine's timings)
        after = spec_record(pd.decode)
        assert accepted_per_drafting_round(before, after) >= FLOORS[method], after["rounds_by_guard"]
    log = pd.prefill.log_text()
    assert "NIXL agent on host memory (DRAM), progressed every 1 ms" in log
    assert "Scheduler hit an exception" not in log + pd.decode.log_text()
    if method == "nextn_tree2":
        pd.stop()  # not needed again
    if method == "nospec":
        other = pairs.get("dspark_adaptive") or _pd(pairs, "dspark_adaptive")  # (run alone: -k nospec)
        faults(pd, other.decode, prompts)


def faults(pd: PDServers, other: SGLangServer, prompts) -> None:
    """Run on the no-speculation pair after its lossless checks (the module owns its pairs: these
    checks kill decode servers; tests/e2e/pool.py). `other`: the DSpark pair's decode server."""
    host_port = rf"[\d.]+:{pd.bootstrap_port}"  # the prefill server's bootstrap server
    # A decode peer whose layout differs (DSpark's draft state and speculative rows on its side,
    # none on this prefill side) is refused at bootstrap, naming both layouts: SGLang stops that
    # decode server's scheduler with the message, as it does for any layout mismatch. The prefill
    # side gives up on the request after its bootstrap timeout, naming it and that no decode peer
    # claimed it, and serves on.
    # At the same time (independent, and each waits out a timeout), this pair's decode side waits
    # for a prefill peer that never got its request (a router that lost it): it gives up after its
    # waiting timeout naming the request and the prefill peer, and frees.
    assert other.alive
    pd.prefill.mark()
    with ThreadPoolExecutor(2) as ex:
        refused = ex.submit(_bootstrapped, pd, other, prompts[1])
        lost = ex.submit(_post, pd.decode, _room_body(pd, prompts[2]), TIMEOUT_S + 60)
        answer, lost = refused.result(), lost.result()
    assert answer.get("status") == 500 and "timed out" in answer["error"], answer
    unclaimed = (
        rf"rid='[0-9a-f]+' req.bootstrap_room=\d+ .*timed out after .*; "
        rf"no decode peer claimed the room at this prefill server's bootstrap server {host_port}"
    )
    assert re.search(unclaimed, pd.prefill.log_since()), pd.prefill.log_tail(20)
    pattern = r"prefill server has kv_layout=(.*), but decode server has kv_layout=(.*)\."
    refusal = re.search(pattern, other.log_text())
    assert refusal, other.log_tail(40)
    assert "draft rows 0 tensors" in refusal[1] and "draft rows 3 tensors" in refusal[2], refusal[0]
    assert pd.prefill.alive and pd.prefill.used_tokens() == 0
    assert lost.get("status") == 500, lost
    named = rf"bootstrap_room=\d+ .*timed out after .*; prefill peer at bootstrap address {host_port}"
    assert re.search(named, lost["error"]), lost
    assert pd.decode.used_tokens() == 0
    assert pd.generate(prompts[1], 8).get("output_ids"), "the pair serves on after both"

    # The decode server killed (SIGKILL) mid-transfer: a 2048-token prompt's state moves in 16
    # chunks and the decode side dies once the prefill side ran two. The prefill side's request
    # fails with NIXL's disconnect named, its slots come back and it serves on.
    body = _room_body(pd, (prompts[3] * 16)[:2048])
    pd.prefill.mark()
    with ThreadPoolExecutor(2) as ex:
        prefilled = ex.submit(_post, pd.prefill, body, TIMEOUT_S + 60)
        ex.submit(_post, pd.decode, body, 60)
        deadline = time.monotonic() + 60
        while len(re.findall("Prefill batch", pd.prefill.log_since())) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        pd.decode.kill()
        chunks_run = len(re.findall("Prefill batch", pd.prefill.log_since()))
        answer = prefilled.result()
    assert 2 <= chunks_run < 16, f"the decode side was killed after {chunks_run} of 16 chunks"
    assert answer.get("status") == 500 and "NIXL_ERR_REMOTE_DISCONNECT" in answer["error"], answer
    assert _eventually(lambda: pd.prefill.used_tokens() == 0), pd.prefill.used_tokens()

    # The decode side gone: a request through the router fails; one the prefill side holds for
    # it (sent as the router sends it) times out there naming the request, and the prefill side
    # frees its slots and serves on (its health check passes).
    assert "error" in pd.generate(prompts[2], N_NEW)
    pd.prefill.mark()
    answer = _bootstrapped(pd, pd.decode, prompts[2])
    assert answer.get("status") == 500 and "timed out" in answer["error"], answer
    assert re.search(unclaimed, pd.prefill.log_since()), pd.prefill.log_tail(20)
    assert pd.prefill.used_tokens() == 0
    assert pd.prefill.alive and pd.prefill.get("/health")[0] == 200
    assert "Scheduler hit an exception" not in pd.prefill.log_text()


def _room_body(pd: PDServers, input_ids) -> dict:
    """A request as SGLang's router sends it to both sides: the prefill side's bootstrap server
    and one room."""
    return {
        "input_ids": input_ids,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0},
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": pd.bootstrap_port,
        "bootstrap_room": int.from_bytes(os.urandom(7), "big"),
    }


def _post(srv: SGLangServer, body: dict, timeout: float) -> dict:
    try:
        return post_json(srv.url + "/generate", body, timeout)
    except OSError as e:  # the server may be gone
        return {"status": None, "error": repr(e)}


def _bootstrapped(pd: PDServers, decode: SGLangServer, input_ids) -> dict:
    """One request sent to the pair's prefill server and to `decode`: the prefill side's answer
    (the decode side's is not waited for)."""
    body = _room_body(pd, input_ids)
    threading.Thread(target=_post, args=(decode, body, 30), daemon=True).start()
    return _post(pd.prefill, body, TIMEOUT_S + 60)


def _eventually(check, seconds: float = 30) -> bool:
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.25)
    return True
