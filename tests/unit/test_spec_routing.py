"""Which worker SGLang gets for a speculative algorithm: ours for EAGLE / NEXTN / DSPARK on DeepSeek-V4 on
any platform (the CPU platform's OOT seam, or the hook for SGLang's builtin NPU platform, which is
never asked), SGLang's own for everything else."""

from types import SimpleNamespace

import pytest

from sglang_dsv4_ascend import checkpoint


@pytest.fixture
def worker(monkeypatch):
    from sglang_dsv4_ascend.speculative import worker as w

    return w


def test_builtin_platform_gets_our_worker_for_eagle_on_dsv4(worker, monkeypatch):
    from sglang_dsv4_ascend.integration.hooks.nextn_worker_on_builtin_platforms import platform_worker_cls

    monkeypatch.setattr(checkpoint, "serves_dsv4", lambda: True)
    for name in ("EAGLE", "NEXTN", "DSPARK"):
        assert platform_worker_cls(lambda self: None, SimpleNamespace(name=name)) is worker.DSV4SpecWorker
    assert platform_worker_cls(lambda self: None, SimpleNamespace(name="NGRAM")) is None
    platform_own = object()  # an OOT platform's answer is kept
    assert platform_worker_cls(lambda self: platform_own, SimpleNamespace(name="EAGLE")) is platform_own


def test_other_models_keep_sglang_workers(worker, monkeypatch):
    from sglang_dsv4_ascend.integration.hooks.nextn_worker_on_builtin_platforms import platform_worker_cls

    monkeypatch.setattr(checkpoint, "serves_dsv4", lambda: False)
    assert platform_worker_cls(lambda self: None, SimpleNamespace(name="EAGLE")) is None
    assert worker.worker_cls_for("EAGLE") is None


@pytest.mark.parametrize(
    "topk,steps,tokens,dsv4,ours",
    [(4, 3, 8, True, 12), (2, 3, 6, True, 6), (1, 3, 4, True, None), (4, 3, 8, False, None)],
)
def test_a_tree_round_reserves_what_the_worker_writes(monkeypatch, topk, steps, tokens, dsv4, ours):
    """Hook tree_kv_reservation on SGLang's own sizing: with 128-token pages SGLang reserves a
    page run per tree branch (2 pages x topk); for a tree our worker serves, a round reserves
    max(steps x topk, draft tokens), which covers the accepted path it commits (steps + 1). Chains
    and other models keep SGLang's figure."""
    from sglang.srt import runtime_context
    from sglang.srt.mem_cache import allocation_sizing as A

    from sglang_dsv4_ascend.integration.hooks.tree_kv_reservation import alloc_len_per_decode

    spec = SimpleNamespace(
        speculative_algorithm="EAGLE",
        speculative_eagle_topk=topk,
        speculative_num_steps=steps,
        speculative_num_draft_tokens=tokens,
    )
    monkeypatch.setattr(runtime_context, "get_spec", lambda: spec)
    monkeypatch.setattr(A, "get_spec", lambda: spec)
    monkeypatch.setattr(A, "get_alloc_page_size", lambda: 128)
    monkeypatch.setattr(A, "max_speculative_num_draft_tokens", lambda: tokens)
    monkeypatch.setattr(checkpoint, "serves_dsv4", lambda: dsv4)
    sglang = A.get_alloc_len_per_decode()
    assert sglang == (max(2 * 128 * topk, tokens) if topk > 1 else max(steps, tokens))
    got = alloc_len_per_decode(A.get_alloc_len_per_decode)
    assert got == (sglang if ours is None else ours)
    assert got >= steps + 1  # the accepted path a round commits
