"""The radix (prefix) cache for DeepSeek-V4 through a real SGLang server: requests that reuse an
earlier request's prefix give exactly the greedy tokens of a server without the cache (every
prompt computed cold), the hit is reported in `cached_tokens` and ends at a page boundary with a
saved state, and under eviction pressure outputs stay identical, nothing fails, and the
allocator's tokens come back."""

import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from spec_prompts import EXACT_ROUNDS

pytestmark = pytest.mark.e2e

N_NEW = 8
PAGE = 128


@pytest.fixture(scope="module")
def tiny_dsv4(tiny_checkpoint):
    return tiny_checkpoint("flash", "nextn")


def _ids(n, seed):
    return torch.randint(100, 900, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _ids(300, 1)  # a shared system prompt: its end (300) lies inside the third page
# three 700-token prompts sharing their first 300 tokens (5 boundaries each, 3 states in the store)
BRANCHING = [_ids(300, 60) + _ids(400, 61 + i) for i in range(3)]
BASE = _ids(400, 2)
# (name, earlier request that leaves the prefix in the tree, the prompt that reuses it, expected hit)
CASES = [
    # 90 % of the prompt shared; the hit ends at the deepest page boundary (256) below 360
    ("ninety_percent", BASE[:360] + _ids(20, 3), BASE[:360] + _ids(40, 4), 256),
    # the shared part ends inside a C4 block (258 = 4 * 64 + 2): the hit stops at the page, 256
    ("inside_c4_block", BASE[:258] + _ids(30, 5), BASE[:258] + _ids(30, 6), 256),
    # shared part ends exactly on a C128 block boundary, inside the earlier request's window
    ("c128_boundary", BASE[:256] + _ids(4, 7), BASE[:256] + _ids(50, 8), 256),
    # the same prompt again: everything but the last page boundary's remainder
    ("same_prompt", BASE[:300], BASE[:300], 256),
]


def _gen(srv, ids):
    out = srv.generate(ids, N_NEW, ignore_eos=True)
    return out["output_ids"], out["meta_info"]["cached_tokens"]


def _flush(srv) -> None:
    """SGLang refuses a flush (400) while a request is still being retired: retry briefly."""
    deadline = time.monotonic() + 30
    while True:
        req = urllib.request.Request(srv.url + "/flush_cache", data=b"{}", method="POST")
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == 200
                return
        except urllib.error.HTTPError as e:
            if e.code != 400 or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cold_outputs(server_pool, tiny_dsv4):
    """Greedy outputs of every prompt with the radix cache off: each computed from position 0."""
    prompts = [p for _, e, q, _ in CASES for p in (e, q)]
    prompts += [SYSTEM + _ids(40, 100 + i) for i in range(6)]
    prompts += [_ids(700, 200 + i) for i in range(6)]
    prompts += BRANCHING
    srv = server_pool.get(tiny_dsv4, "--disable-radix-cache")
    assert srv.server_info()["disable_radix_cache"] is True
    return {tuple(p): srv.generate(p, N_NEW, ignore_eos=True)["output_ids"] for p in prompts}


def test_prefix_hits_equal_cold_serving(tiny_dsv4, cold_outputs, servers):
    srv = servers.get(tiny_dsv4, "--chunked-prefill-size", "256", "--enable-mixed-chunk")
    info = srv.server_info()
    assert info["disable_radix_cache"] is False and info["radix_cache_backend"] == "dsv4_ascend"
    assert "radix (prefix) cache disabled" not in srv.log_text()
    idle = srv.used_tokens()
    for name, earlier, prompt, hit in CASES:
        out, cached = _gen(srv, earlier)
        assert out == cold_outputs[tuple(earlier)], name
        out, cached = _gen(srv, prompt)
        assert cached == hit, (name, cached)
        assert out == cold_outputs[tuple(prompt)], name

    # Many requests sharing one system prompt, concurrently: the first computes it, the others
    # resume from the state saved at 256, inside the first request's 256-token prefill chunk.
    first = SYSTEM + _ids(40, 100)
    out, cached = _gen(srv, first)
    assert out == cold_outputs[tuple(first)]
    rest = [SYSTEM + _ids(40, 100 + i) for i in range(1, 6)]
    with ThreadPoolExecutor(len(rest)) as ex:
        results = list(ex.map(lambda p: _gen(srv, p), rest))
    assert [o for o, _ in results] == [cold_outputs[tuple(p)] for p in rest]
    assert all(c == 256 for _, c in results), [c for _, c in results]

    # Everything the tree holds is freed by a flush: the allocator is back where it started.
    _flush(srv)
    deadline = time.monotonic() + 30
    while srv.used_tokens() != idle and time.monotonic() < deadline:
        time.sleep(0.2)
    assert srv.used_tokens() == idle


def test_eviction_pressure_keeps_outputs_and_requests(tiny_dsv4, cold_outputs, servers):
    """A token pool of 2048 tokens and 3 prefix states for 700-token prompts: the tree and the
    state store both evict while requests run; every output equals cold serving, none fails."""
    srv = servers.get(
        tiny_dsv4, "--max-total-tokens", "2048", "--max-running-requests", "3", env={"SGLANG_DSV4_PREFIX_STATES": "3"}
    )
    idle = srv.used_tokens()
    long = [_ids(700, 200 + i) for i in range(6)]
    with ThreadPoolExecutor(3) as ex:
        rounds = [list(ex.map(lambda p: _gen(srv, p), long)) for _ in range(2)]
    for results in rounds:
        assert [o for o, _ in results] == [cold_outputs[tuple(p)] for p in long]
    # the second round found some prefixes still cached, each at a page boundary
    assert all(c % PAGE == 0 for r in rounds for _, c in r)
    # A shared part that ends inside longer prompts: the first request keeps only its deepest 3
    # states, so the first sharer misses 256 (the tree hints it) and keeps it; the next one hits.
    outs = [_gen(srv, p) for p in BRANCHING]
    assert [o for o, _ in outs] == [cold_outputs[tuple(p)] for p in BRANCHING]
    assert outs[1][1] < 256 and outs[2][1] == 256, [c for _, c in outs]
    assert "prefix states: 3 x" in srv.log_text()
    deadline = time.monotonic() + 30
    _flush(srv)
    while srv.used_tokens() != idle and time.monotonic() < deadline:
        time.sleep(0.2)
    assert srv.used_tokens() == idle


def test_bench_prefix_counts_the_servers_hits(tiny_dsv4):
    """`bench prefix` through a server: the hit it reports is the server's page-aligned
    `cached_tokens`, and the prefill it reports is what remained (timings are not asserted)."""
    from sglang_dsv4_ascend.bench.prefix import run

    rows = run(tiny_dsv4, [512], [0.5, 0.9], repeats=1)["results"]
    (row,) = rows
    assert row["cold"]["prefill_tokens"] == 512
    for who in ("first_sharer", "later_sharer"):
        assert row["hit_50pct"][who]["cached_tokens"] == 256 and row["hit_50pct"][who]["prefill_tokens"] == 256
        assert row["hit_90pct"][who]["cached_tokens"] == 384 and row["hit_90pct"][who]["prefill_tokens"] == 128


SPEC_STATS = ("spec_verify_ct", "spec_accept_length", "spec_correct_drafts_histogram")


@pytest.fixture(scope="module")
def code_prompt():
    """262 tokens of real code text for the trained tiny model (its drafts accept): a hit at 256
    leaves 6 tokens to prefill, so the drafts' windows lie mostly in the restored rows."""
    from prompts import load_prompts
    from transformers import AutoTokenizer

    import sglang_dsv4_ascend as pkg

    tok = AutoTokenizer.from_pretrained(pkg.TINY_MODEL_PATH)
    ids = tok("\n".join(load_prompts("humaneval", 6, max_chars=None)), add_special_tokens=False).input_ids
    assert len(ids) >= 262
    return ids[:262]


# One method per draft: what a hit restores is the draft's state (NextN's window, DSpark's
# context), whatever verifies its drafts (a NextN tree 4 case, on a server of its own, was ~12 s
# of CI for the chain's state again)
@pytest.mark.parametrize("method", ["nextn_chain", "dspark_static"])
def test_speculative_prefix_hit_drafts_like_cold(method, code_prompt, servers):
    """With speculation the prefix cache stays on: a request that resumes a 256-token prefix
    another request left (target, NextN window / DSpark context restored from the state) gives
    the same greedy tokens AND the same per-round acceptance as the same request served cold on
    the same server, so its drafts were made from exactly the cold draft state (the trained model
    accepts often, so a wrong draft state would move the counts)."""
    from sglang_dsv4_ascend.bench import headline

    ckpt, env, flags = headline.METHODS[method]
    # every round drafts (no speculation guard: whether it steps plain depends on timings, and the
    # two requests' rounds are compared one for one); earlier tests' prefixes go first
    srv = servers.get(ckpt, *headline.POOL, *flags, env={**env, **EXACT_ROUNDS})
    assert srv.server_info()["disable_radix_cache"] is False

    def gen(ids):
        return srv.generate(ids, 32, ignore_eos=True)

    _flush(srv)
    cold = gen(code_prompt)
    assert cold["meta_info"]["cached_tokens"] == 0
    assert cold["meta_info"]["spec_accept_length"] > 1.5, cold["meta_info"]  # drafts really accepted
    _flush(srv)
    gen(code_prompt[:257] + _ids(40, 9))  # leaves the prefix (and its state at 256) in the tree
    hit = gen(code_prompt)
    assert hit["meta_info"]["cached_tokens"] == 256
    assert hit["output_ids"] == cold["output_ids"]
    assert {k: hit["meta_info"][k] for k in SPEC_STATS} == {k: cold["meta_info"][k] for k in SPEC_STATS}
