"""The per-request speculative counters a client reads (hook spec_accept_length_from_rounds around
SGLang's own `_calculate_spec_decoding_metrics`): the accept length counts only the tokens verify
rounds committed, so tokens decoded as plain one-token steps in mixed chunks (or the prefill's
token) never raise it past the block, and a request without a verify round still has counters.
The oracle is the definition: tokens per round from the request's histogram of correct drafts."""

from types import SimpleNamespace

import pytest
from sglang.srt.managers import tokenizer_manager as tm

from sglang_dsv4_ascend.integration.hooks.spec_accept_length_from_rounds import verify_round_metrics

DRAFT_TOKENS = 5  # block size 4 + the anchor


@pytest.fixture(autouse=True)
def spec_config(monkeypatch):
    monkeypatch.setattr(tm, "get_spec", lambda: SimpleNamespace(speculative_num_draft_tokens=DRAFT_TOKENS))


def recv(completion, hists):
    """A batch output as the scheduler sends it: per request its completion tokens and its
    histogram of correct drafts per verify round."""
    return SimpleNamespace(
        completion_tokens=completion,
        spec_verify_ct=[sum(h) for h in hists],
        spec_num_correct_drafts=[sum(k * v for k, v in enumerate(h)) for h in hists],
        spec_correct_drafts_histogram=hists,
        spec_num_cap_tokens=None,
        spec_cap_lens_histogram=None,
        spec_num_block_accept_tokens=None,
    )


def tokens_per_round(hist):
    return sum((k + 1) * v for k, v in enumerate(hist)) / sum(hist)


def metrics(fn, out, i):
    meta = {}
    fn(meta, out, i)
    return meta


def hooked(meta, out, i):
    return verify_round_metrics(tm.TokenizerManager._calculate_spec_decoding_metrics, None, meta, out, i)


def sglang_only(meta, out, i):
    return tm.TokenizerManager._calculate_spec_decoding_metrics(None, meta, out, i)


# request 0: 5 rounds committing 17 tokens, plus the prefill's token and 22 plain tokens from
# mixed chunks (40 in all); request 1: every round full; request 2: one token, no round at all
OUT = recv([40, 1 + 3 * DRAFT_TOKENS + 7, 1], [[0, 1, 2, 1, 1], [0, 0, 0, 0, 3], []])


def test_accept_length_counts_verify_rounds_only():
    for i in (0, 1):
        meta = metrics(hooked, OUT, i)
        want = tokens_per_round(OUT.spec_correct_drafts_histogram[i])
        assert meta["spec_accept_length"] == pytest.approx(want)
        assert 1 <= meta["spec_accept_length"] <= DRAFT_TOKENS
        assert meta["spec_verify_ct"] == OUT.spec_verify_ct[i]
        assert meta["spec_accept_rate"] == pytest.approx(OUT.spec_num_correct_drafts[i] / (OUT.spec_verify_ct[i] * 4))
    assert metrics(hooked, OUT, 1)["spec_accept_length"] == DRAFT_TOKENS  # full rounds: the whole block + bonus


def test_sglang_alone_counts_mixed_tokens_as_accepted():
    """The broken variant the hook exists for: all completion tokens / rounds."""
    assert metrics(sglang_only, OUT, 0)["spec_accept_length"] == 40 / 5 > DRAFT_TOKENS
    assert metrics(sglang_only, OUT, 1)["spec_accept_length"] > DRAFT_TOKENS


def test_a_request_without_a_round_still_has_its_counters():
    assert "spec_verify_ct" not in metrics(sglang_only, OUT, 2)
    meta = metrics(hooked, OUT, 2)
    assert meta["spec_verify_ct"] == meta["spec_num_correct_drafts"] == meta["spec_num_proposed_drafts"] == 0
    assert meta["spec_accept_length"] == meta["spec_accept_rate"] == 0.0


def test_without_speculative_counters_nothing_is_added():
    meta = {}
    verify_round_metrics(lambda *a: None, None, meta, SimpleNamespace(completion_tokens=[3]), 0)
    assert meta == {}
