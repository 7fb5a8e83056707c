"""The pool check of the request boundary (request_guard.output_budget / check_fits): a request the
scheduler can never admit, or would answer with no output, is refused; the largest one it admits
is served whole. The arithmetic is checked against SGLang 0.5.23's own code (its allocator's clip,
its prefill budget, its speculative decode reservation), so a drift from what the scheduler does,
or a variant that drops a term (page rounding, the speculative rows), fails here."""

from types import SimpleNamespace as NS

import pytest

from sglang_dsv4_ascend.integration import request_guard as G
from sglang_dsv4_ascend.integration.hooks.request_validation import validate_one_request_hook

torch = pytest.importorskip("torch")
paged = pytest.importorskip("sglang.srt.mem_cache.allocator.paged")
budget_mod = pytest.importorskip("sglang.srt.mem_cache.prefill_budget")
sizing = pytest.importorskip("sglang.srt.mem_cache.allocation_sizing")

P = 128
# (pool tokens, context length): the issue's server, the e2e server, a pool that is not page-aligned,
# a pool smaller than the context, a context smaller than the pool
SHAPES = [(32768, 32768), (8192, 8192), (8192 + 100, 8192), (8192, 32768), (16384, 4096)]


# -- SGLang's own code as the oracle ------------------------------------------------------------


def sglang_clip(n, m, pool, ctx, page=P):
    """scheduler.init_req_max_new_tokens: the context term, then the allocator's memory term."""
    alloc = paged.PagedTokenToKVPoolAllocator(pool, page, torch.float32, "cpu", None, False)
    m = (1 << 30) if m is None else m
    max_req_len = min(ctx - 1, pool - 1)  # tp_worker.get_worker_info
    m = max(0, min(m, max_req_len - n - 1))
    return max(
        0, alloc.max_new_tokens_for_memory(n, m, token_capacity=pool, sliding_window_size=None, chunk_size=None)
    ), alloc


def sglang_admits(n, m, alloc, page=P):
    """PrefillAdder.add_one_req on an empty pool: total = extend + clipped budget + one page."""
    tree = NS(supports_mamba=lambda: False, evictable_size=lambda: 0)
    budget = budget_mod.PrefillBudget(alloc, tree)
    total = n + min(m, G.CLIP_MAX_NEW_TOKENS) + page
    return budget.check_prefill(
        extend_input_len=n,
        total_tokens=total,
        max_new_tokens=m,
        input_tokens=n,
        swa_host_hit_length=0,
        chunk_limit=None,
    )[0]


def sglang_last_round_fits(n, m, alloc, reserve, page=P):
    """eagle_prepare_for_decode's allocation for the last round (committed n + m - 2) fits the pool."""
    if not reserve or m < 2:
        return True
    committed = n + m - 2
    r = NS(kv=NS(kv_allocated_len=-(-committed // page) * page, kv_committed_len=committed))
    _, nxt, _ = sizing.page_aligned_decode_alloc_lens([r], reserve=reserve, page_size=page)
    return nxt[0] <= alloc.available_size()


def oracle(n, m, pool, ctx, reserve=0, page=P):
    """(clipped, served) by SGLang's code: served = the largest budget up to the clip that is admitted
    and whose last round fits, None if the scheduler does not even admit the prompt alone."""
    clipped, alloc = sglang_clip(n, m, pool, ctx, page)
    if not sglang_admits(n, 0, alloc, page):
        return clipped, None
    ok = lambda k: sglang_admits(n, k, alloc, page) and sglang_last_round_fits(n, k, alloc, reserve, page)  # noqa: E731
    lo, hi = 0, clipped  # ok() is monotone: a smaller budget never fits worse
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return clipped, lo


def prompts_near_the_edge(pool, ctx, page=P):
    avail = pool // page * page
    edge = min(avail, ctx)
    out = {1, page, page + 1}
    for base in (avail - 2 * page, avail - page, ctx - 7, edge - 3 * page):
        out.update(base + d for d in (-2, -1, 0, 1, 2) if 0 < base + d < ctx)
    return sorted(out)


def assert_matches_sglang(reserve=0):
    for pool, ctx in SHAPES:
        lim = G.PoolLimits(pool, P, ctx, decode_reserve=reserve)
        for n in prompts_near_the_edge(pool, ctx):
            for m in (0, 1, 2, 16, 60, P - 1, P, 3000, None):
                assert G.output_budget(n, m, lim) == oracle(n, m, pool, ctx, reserve), (pool, ctx, reserve, n, m)


# -- the arithmetic ------------------------------------------------------------------------------


def test_the_budget_is_what_sglangs_scheduler_computes():
    assert_matches_sglang()


@pytest.mark.parametrize("reserve", [10, 8, 1024, 2048])  # DSpark block 4, chain of 4, trees topk 2 and 4
def test_the_budget_with_speculative_rows_is_what_sglangs_scheduler_computes(reserve):
    assert_matches_sglang(reserve)


def test_the_issues_requests():
    lim = G.PoolLimits(32768, P, 32768)
    assert G.output_budget(32700, 60, lim) == (0, None)  # never admitted: the server spun on it
    assert G.output_budget(32640, 16, lim) == (0, None)  # the DSpark server's, same arithmetic
    assert G.output_budget(32600, 16, lim) == (0, 0)  # admitted with no budget: the empty 200 after 119 s
    dspark = G.PoolLimits(32768, P, 32768, decode_reserve=10)
    assert G.output_budget(32640, 16, dspark) == (0, None)


@pytest.mark.parametrize("reserve", [0, 10])
@pytest.mark.parametrize("pool,ctx", SHAPES)
def test_the_largest_request_is_served_whole_and_one_page_more_is_refused(pool, ctx, reserve):
    lim = G.PoolLimits(pool, P, ctx, decode_reserve=reserve)
    avail = pool // P * P
    most = G.largest_prompt(lim)
    assert G.output_budget(most, 1, lim)[1] == 1
    assert fits(most, 1, lim) == {"max_new_tokens": 1}
    if avail - 2 * P < G.max_input_len(lim):  # the pool binds: the prompt's pages, one for output, one kept free
        if pool == avail:  # as SGLang sizes it (page-aligned); otherwise the clip counts more than there is
            assert most == avail - 2 * P
            assert G.output_budget(most, P - 1, lim) == (P - 1, P - 1)
            assert fits(most, P - 1, lim) == {"max_new_tokens": P - 1}
        for more in (1, P):  # a token more, a page more (below the limit where SGLang answers itself)
            if most + more >= G.max_input_len(lim):
                continue
            with pytest.raises(G.RequestRejected, match=f"input_ids: {most + more} prompt tokens"):
                fits(most + more, 1, lim)
    else:  # the context binds: longer prompts get SGLang's own input-length error
        assert most == G.max_input_len(lim) - 1 == min(ctx, pool) - 7
        assert fits(most + 1, 1, lim) == {"max_new_tokens": 1}


def test_speculative_rows_matter_only_where_a_round_reserves_more_than_the_free_page():
    plain, dspark, tree = (G.PoolLimits(8192, P, 8192, decode_reserve=r) for r in (0, 10, 2048))
    for n in (1, 4000, 7000, 7936):
        assert G.output_budget(n, None, dspark) == G.output_budget(n, None, plain)
    # a tree's round reserves 2 x topk pages: near the end of the pool only the prefill's token is left
    assert G.output_budget(7936, P - 1, tree) == (P - 1, 1)
    assert G.output_budget(6000, None, tree) == (8192 - 6016 - P - 1, 8192 - 6000 - 2048 + 2)
    assert G.largest_prompt(tree) == G.largest_prompt(plain)  # one token needs no decode round


def test_prompt_only_requests():
    lim = G.PoolLimits(8192, P, 8192)
    fits(8192 - P - 1, 0, lim)  # a prompt with no output asked for is admitted while prompt + page < pool
    with pytest.raises(G.RequestRejected, match="8064 prompt tokens \\+ max_new_tokens 0 .*wait forever"):
        fits(8192 - P, 0, lim)


def test_ignore_eos_without_the_radix_cache_takes_one_token_less():
    """add_one_req_ignore_eos (radix cache off) refuses a budget the clip gives exactly: the request
    would wait forever; it is served with one token less."""
    lim = G.PoolLimits(8192, P, 8192, radix_disabled=True)
    clip = 8192 - P - P - 1
    assert G.output_budget(100, 8000, lim, ignore_eos=True) == (clip, clip - 1)
    assert G.output_budget(100, 8000, lim, ignore_eos=False) == (clip, clip)  # the other path
    shared = G.PoolLimits(8192, P, 8192)
    assert G.output_budget(100, 8000, shared, ignore_eos=True) == (clip, clip)
    obj = NS(sampling_params={"max_new_tokens": 8000, "ignore_eos": True})
    G.check_fits(obj, 100, obj.sampling_params, lim)
    assert obj.sampling_params == {"max_new_tokens": clip - 1, "ignore_eos": True}
    # a clip of one token leaves none on this path: refused, not queued (small pages, a pool that is
    # not page-aligned: the clip counts 66 tokens, the allocator 64)
    tiny = G.PoolLimits(66, 4, 1000, radix_disabled=True)
    assert G.output_budget(58, 5, tiny, ignore_eos=True) == (1, 0)
    assert G.output_budget(58, 5, tiny) == (1, 1)
    with pytest.raises(G.RequestRejected, match="58 prompt tokens"):
        fits(58, 5, tiny, ignore_eos=True)


# -- the check -----------------------------------------------------------------------------------


def fits(n, m, lim, **params):
    obj = NS(sampling_params={"max_new_tokens": m, **params})
    G.check_fits(obj, n, obj.sampling_params, lim)
    return obj.sampling_params


def test_refusals_name_the_fields_the_flags_and_the_numbers():
    lim = G.PoolLimits(32768, P, 32768)
    with pytest.raises(G.RequestRejected) as e:
        fits(32700, 60, lim)
    text = str(e.value)
    for words in (
        "input_ids: 32700 prompt tokens + max_new_tokens 60",
        "256 pages of 128 tokens",
        "holds 32768 tokens",
        "--max-total-tokens",
        "--context-length 32768",
        "At most 32512 prompt tokens",
        "up to 127 new tokens",
    ):
        assert words in text, (words, text)
    with pytest.raises(G.RequestRejected, match="max_new_tokens null"):
        fits(32600, None, lim)
    spec = G.PoolLimits(32768, P, 32768, decode_reserve=10)
    with pytest.raises(G.RequestRejected, match="each speculative decode round reserves 10 rows"):
        fits(32600, 16, spec)


def test_what_sglang_answers_with_its_own_error_is_left_to_it():
    lim = G.PoolLimits(8192, P, 8192)
    assert fits(8192, 4, lim) == {"max_new_tokens": 4}  # prompt past the context: SGLang refuses it
    assert fits(8000, 500, lim) == {"max_new_tokens": 500}  # prompt + output past the context: likewise
    assert fits(8186, 1, lim) == {"max_new_tokens": 1}  # past the scheduler's input limit: it answers the error
    with pytest.raises(G.RequestRejected, match="8185 prompt tokens"):
        fits(8185, 1, lim)
    with pytest.raises(G.RequestRejected, match="8000 prompt tokens \\+ max_new_tokens 192"):
        G.check_fits(NS(), 8000, {"max_new_tokens": 500}, lim, truncates=True)  # truncated to what fails


def test_served_requests_are_left_alone_unless_the_clip_would_leave_them_unfinishable():
    plain = G.PoolLimits(8192, P, 8192)
    assert fits(100, 5000, plain) == {"max_new_tokens": 5000}
    assert fits(100, 100_000, plain) == {"max_new_tokens": 100_000}  # SGLang clips it the same way itself
    tree = G.PoolLimits(8192, P, 8192, decode_reserve=2048)
    assert fits(6000, 1000, tree) == {"max_new_tokens": 8192 - 6000 - 2048 + 2}
    assert fits(6000, 100, tree) == {"max_new_tokens": 100}


def test_sglangs_speculative_reservation():
    """The rows a decode round reserves per request, as SGLang computes them for our configurations
    (what `_decode_reserve` reads at run time)."""

    def reserve(algo, steps, topk, tokens, monkeypatch):
        spec = NS(
            speculative_algorithm=algo,
            speculative_num_steps=steps,
            speculative_eagle_topk=topk,
            speculative_num_draft_tokens=tokens,
            max_speculative_num_draft_tokens=None,
        )
        monkeypatch.setattr(sizing, "get_spec", lambda: spec)
        monkeypatch.setattr(sizing, "get_schedule", lambda: NS(page_size=P))
        monkeypatch.setattr(sizing, "get_parallel", lambda: NS(attn_dcp_size=1))
        monkeypatch.setattr(sizing, "max_speculative_num_draft_tokens", lambda: tokens)
        return sizing.get_alloc_reserve_per_decode()

    mp = pytest.MonkeyPatch()
    try:
        assert reserve("DSPARK", 4, 1, 5, mp) == 10
        assert reserve("NEXTN", 3, 1, 4, mp) == 8
        assert reserve("NEXTN", 3, 2, 6, mp) == 1024
        assert reserve("NEXTN", 3, 4, 8, mp) == 2048
    finally:
        mp.undo()


# -- broken variants the tests above catch ------------------------------------------------------


def test_a_budget_without_page_rounding_is_caught(monkeypatch):
    monkeypatch.setattr(G, "_ceil", lambda x, page: x)
    with pytest.raises(AssertionError):
        assert_matches_sglang()


def test_a_budget_without_the_speculative_rows_is_caught(monkeypatch):
    real = G.output_budget
    monkeypatch.setattr(
        G,
        "output_budget",
        lambda n, m, lim, **kw: real(n, m, G.PoolLimits(lim.pool_tokens, lim.page_size, lim.context_len), **kw),
    )
    with pytest.raises(AssertionError):
        assert_matches_sglang(2048)


# -- where the hook gets the limits ---------------------------------------------------------------


def tokenizer_manager(**args):
    server_args = NS(page_size=None, speculative_algorithm=None, disable_radix_cache=False, **args)
    hf = NS(architectures=["DeepseekV4ForCausalLM"])
    return NS(
        server_args=server_args,
        context_len=8192,
        model_config=NS(hf_config=hf, vocab_size=1024),
        validate_total_tokens=True,
        allow_auto_truncate=False,
    )


def test_the_hook_reads_the_pool_the_scheduler_reported(monkeypatch):
    tm = tokenizer_manager()
    # the resolved page size, not the command line's (None: the plugin's override chose 128)
    monkeypatch.setattr(G, "_published_config", lambda: (P, False))
    monkeypatch.setitem(
        __import__("sys").modules,
        "sglang.srt.entrypoints.http_server",
        NS(_global_state=NS(scheduler_info={"max_total_num_tokens": 8192})),
    )
    assert G.pool_limits(tm) == G.PoolLimits(8192, P, 8192)
    obj = NS(text=None, input_ids=None, input_embeds=None, return_logprob=False, sampling_params={"max_new_tokens": 60})
    with pytest.raises(G.RequestRejected, match="input_ids: 8100 prompt tokens \\+ max_new_tokens 60"):
        validate_one_request_hook(tm, obj, [1] * 8100)
    obj.sampling_params = {"max_new_tokens": 60}
    assert validate_one_request_hook(tm, obj, [1] * 7000) is None
    # before the scheduler reported (or in an offline Engine, which keeps the record): no pool check
    monkeypatch.setitem(__import__("sys").modules, "sglang.srt.entrypoints.http_server", NS(_global_state=None))
    assert G.pool_limits(tm) is None
    assert validate_one_request_hook(tm, obj, [1] * 8100) is None
