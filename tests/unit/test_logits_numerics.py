"""One logits computation on both paths (issue #29): the speculative engine and the drafts compute
logits through `vocab_parallel.head_matmul`, which must round exactly as SGLang's LogitsProcessor
rounds the served head without speculation (the peer implementation: its own `_compute_lm_head`
is called here), and must be row-invariant, so that a verify row of a k-row forward gets the bits
a one-row decode gets. A deliberately fp32 head (what the engine did before) is caught."""

import pytest
import torch
from torch import nn

from sglang_dsv4_ascend.distributed.layout import Layout
from sglang_dsv4_ascend.layers.vocab_parallel import (
    GatheredHead,
    head_logits,
    head_matmul,
)


def _sglang_head(hidden: torch.Tensor, head: nn.Linear, fp32: bool = False) -> torch.Tensor:
    """SGLang's own LogitsProcessor._compute_lm_head for a plain (one-rank) head."""
    from sglang.srt.layers.logits_processor import LogitsProcessor

    lp = LogitsProcessor.__new__(LogitsProcessor)  # the method reads only these attributes
    nn.Module.__init__(lp)
    lp.use_fp32_lm_head, lp.use_fp32_lm_head_output, lp.rl_on_policy_target = fp32, False, None
    return lp._compute_lm_head(hidden, head)


def _case(dtype, rows=16, d=256, vocab=4096, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = nn.Linear(d, vocab, bias=False).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, d, generator=g) * 0.05)
    return head, (torch.randn(rows, d, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rounds_as_the_served_head(dtype):
    head, h = _case(dtype)
    want = _sglang_head(h, head).float()
    got = head_logits(head, h, Layout(), head.out_features)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    # --enable-fp32-lm-head: the served head computes in fp32, and so does ours
    assert torch.equal(
        head_logits(head, h, Layout(), head.out_features, fp32=True), _sglang_head(h, head, fp32=True).float()
    )


def test_vocab_parallel_columns_round_as_one_rank():
    head, h = _case(torch.bfloat16)
    assert torch.equal(GatheredHead(head, Layout()).apply(None, h).float(), _sglang_head(h, head).float())


def test_bf16_rows_are_row_invariant():
    """A verify row must get the bits of the same row decoded alone (batch of one)."""
    head, h = _case(torch.bfloat16, rows=16)
    full = head_logits(head, h, Layout(), head.out_features)
    alone = torch.cat([head_logits(head, h[i : i + 1], Layout(), head.out_features) for i in range(16)])
    assert torch.equal(full, alone)


def test_an_fp32_head_on_bf16_weights_is_caught():
    """The pre-fix engine: fp32 logits from bf16 hidden states. It differs from the served head's
    bf16 rounding on most rows, which is what moved a near-tie with speculation (#29)."""
    head, h = _case(torch.bfloat16)
    broken = torch.nn.functional.linear(h.float(), head.weight.float())
    served = _sglang_head(h, head).float()
    assert not torch.equal(broken, served)
    assert torch.equal(head_matmul(h, head.weight).float(), served)


# -- what decides a token before the head: the rows of a verify forward vs one-row decodes ---------


def test_mhc_mix_is_row_invariant_and_plain_linear_is_caught():
    """mHC's fp32 mix (ops.reference.mhc_mix) decides every token's stream weights: one row alone
    must get the bits it gets among 5 or 16 (a verify forward's rows). A plain fp32 F.linear takes
    the CPU's small-M kernels below 8 rows and does not (what made bf16 speculation diverge, #29)."""
    import torch.nn.functional as F

    from sglang_dsv4_ascend.ops import reference

    g = torch.Generator().manual_seed(1)
    streams, fn = torch.randn(16, 4, 128, generator=g), torch.randn(24, 4 * 128, generator=g)
    full = reference.mhc_mix(streams, fn, 1e-6)
    for rows in (1, 3, 5):
        part = torch.cat([reference.mhc_mix(streams[i : i + rows], fn, 1e-6) for i in range(0, 15, rows)])
        assert torch.equal(part, full[: part.shape[0]]), rows
    v = reference.rms_norm(streams.flatten(-2), None, 1e-6)
    plain_full, plain_one = F.linear(v, fn), torch.cat([F.linear(v[i : i + 1], fn) for i in range(16)])
    if torch.equal(plain_full, plain_one):
        pytest.skip("this CPU's fp32 matmul is row-invariant by itself: no broken variant to catch")
    assert torch.equal(plain_full, full)  # the padded rows are the blocked gemm's own bits


def test_router_weights_are_row_invariant_and_the_unpadded_softplus_is_caught():
    """The router's fp32 scores go through softplus; on this CPU an elementwise transcendental
    rounds its last numel % 32 elements on the scalar path, so a one-row decode's [1, 8] scores
    came out differently from a verify's rows. layers/moe.Gate computes on padded rows."""
    import torch.nn.functional as F

    from sglang_dsv4_ascend.layers.moe import Gate

    cfg = type(
        "Cfg",
        (),
        dict(num_experts_per_tok=2, routed_scaling_factor=1.5, n_routed_experts=8, hidden_size=64, vocab_size=16),
    )()
    gate = Gate(cfg, is_hash=False)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        gate.weight.copy_(torch.randn(8, 64, generator=g))
    y = torch.randn(40, 64, generator=g).to(torch.bfloat16)
    ids = torch.zeros(40, dtype=torch.long)
    e_all, w_all = gate(y, ids)
    for i in range(40):
        e, w = gate(y[i : i + 1], ids[i : i + 1])
        assert torch.equal(e[0], e_all[i]) and torch.equal(w[0], w_all[i]), i
    x = torch.randn(64, 8, generator=g) * 3
    if torch.equal(F.softplus(x), torch.cat([F.softplus(x[i : i + 1]) for i in range(64)])):
        pytest.skip("this CPU's softplus is row-invariant by itself: no broken variant to catch")


@pytest.fixture(scope="module")
def bf16_model():
    import sglang_dsv4_ascend as pkg
    from sglang_dsv4_ascend.models.weights import load_model_from_dir

    return load_model_from_dir(pkg.TINY_MODEL_PATH, dtype=torch.bfloat16)


def _forward(m, cache, slot, seq, a, b, others=()):
    """Logits of seq[a:b] for `slot`, optionally in one batched forward with `others` (slot, seq,
    start, length) segments after it (their logits are dropped)."""
    from sglang_dsv4_ascend.batch import Segment

    segs, ids, pos = [Segment(slot, a, b - a)], [seq[a:b]], [torch.arange(a, b)]
    for s2, seq2, a2, n2 in others:
        segs.append(Segment(s2, a2, n2))
        ids.append(seq2[a2 : a2 + n2])
        pos.append(torch.arange(a2, a2 + n2))
    return m.compute_logits(m(torch.cat(ids), torch.cat(pos), segs, cache, pending=None))[: b - a]


@pytest.mark.parametrize("prompt_set,index,max_chars", [("humaneval", 6, None), ("gsm8k", 9, 400)])
def test_bf16_verify_rounds_equal_one_row_decodes(bf16_model, prompt_set, index, max_chars):
    """The shipped model in bf16 on a packaged chat prompt: its 48-token greedy continuation run
    as one-row decodes and as 4-row forwards (verify rounds, each reading the caches earlier
    rounds wrote) gives bit-identical logits on every row, so greedy speculation decides every
    token exactly as decoding without it does. These two prompts caught what #29's fix removed:
    the compressor's fp32 projections took the CPU's small-M matmul kernels (humaneval 6: rows
    41-49 differed, one a tie flipped), and the router's softplus took the scalar path for a
    one-row decode (gsm8k 9: rows 23 on)."""
    from transformers import AutoTokenizer

    import sglang_dsv4_ascend as pkg
    from sglang_dsv4_ascend.data import load_prompts
    from sglang_dsv4_ascend.tools.tiny_corpus import chat_prompt

    m = bf16_model
    text = load_prompts(prompt_set, index + 1, max_chars=max_chars)[index]
    prompt = AutoTokenizer.from_pretrained(pkg.TINY_MODEL_PATH)(chat_prompt(text), add_special_tokens=False).input_ids
    L, n = len(prompt), 48
    with torch.no_grad():
        cache = m.make_cache(2, L + n + 8, 0)
        seq = torch.tensor(prompt + [0] * n)
        first = _forward(m, cache, 0, seq, 0, L)[-1].argmax()
        _forward(m, cache, 1, seq, 0, L)
        decoded = []
        seq[L] = first
        for i in range(n):
            decoded.append(_forward(m, cache, 0, seq, L + i, L + i + 1))
            if i + 1 < n:
                seq[L + i + 1] = decoded[-1][0].argmax()
        decoded = torch.cat(decoded)
        verified = torch.cat([_forward(m, cache, 1, seq, L + i, L + i + 4) for i in range(0, n, 4)])
    differ = [i for i in range(n) if not torch.equal(decoded[i], verified[i])]
    assert not differ, f"rows whose logits differ: {differ}"


def test_bf16_a_request_is_computed_alike_beside_a_longer_one(bf16_model):
    """Batch invariance: a request's prefill and verify logits are the same bits alone and in one
    forward with a much longer request (whose key lists set the batch's padded widths). Caught
    before #29's fix (fp32 attention: the masked padding changed the softmax's rounding)."""
    m = bf16_model
    V = m.cfg.vocab_size
    for trial, (short, long) in enumerate([(71, 597), (152, 400)]):
        g = torch.Generator().manual_seed(100 + trial)
        s_seq, l_seq = torch.randint(0, V, (short + 8,), generator=g), torch.randint(0, V, (long + 8,), generator=g)
        with torch.no_grad():
            cache = m.make_cache(4, 700, 0)
            alone = _forward(m, cache, 0, s_seq, 0, short)
            beside = _forward(m, cache, 1, s_seq, 0, short, others=[(2, l_seq, 0, long)])
            assert torch.equal(alone, beside), ("prefill", short, long)
            alone = _forward(m, cache, 0, s_seq, short, short + 4)
            beside = _forward(m, cache, 1, s_seq, short, short + 4, others=[(2, l_seq, long, 1)])
            assert torch.equal(alone, beside), ("verify", short, long)


def test_fp32_linear_rows_are_the_same_alone_and_in_a_batch(monkeypatch):
    """layers.Linear: every row of an fp32 batch of 1..20 rows has the bits of the same row in a
    20-row batch (the CPU's small-M kernels differ for 1-3 rows); plain nn.Linear is caught."""
    from sglang_dsv4_ascend.layers import Linear

    g = torch.Generator().manual_seed(3)
    lin = Linear(128, 512, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(512, 128, generator=g))
        x = torch.randn(20, 128, generator=g)
        full = torch.nn.functional.linear(x, lin.weight)  # 20 rows: the blocked gemm
        assert all(torch.equal(lin(x[:m]), full[:m]) for m in range(1, 21))
        monkeypatch.setattr(Linear, "forward", torch.nn.Linear.forward)
        assert not all(torch.equal(lin(x[:m]), full[:m]) for m in range(1, 4))


@pytest.fixture(scope="module")
def w8a8_model(w8a8_checkpoint):
    from sglang_dsv4_ascend.quantization.w8a8 import load_w8a8_model_from_dir

    return load_w8a8_model_from_dir(w8a8_checkpoint("flash", "nextn"), dtype=torch.float32)


def _alone_and_beside(m):
    """Request 0's one-row decode and 4-row verify logits alone and beside three other requests
    (their decode or verify rows in the same forward)."""
    V, g = m.cfg.vocab_size, torch.Generator().manual_seed(5)
    lens = (150, 90, 201, 60)
    seqs = [torch.randint(0, V, (n + 8,), generator=g) for n in lens]
    out = []
    with torch.no_grad():
        cache = m.make_cache(8, 260, 0)
        for slot, (seq, n) in enumerate(zip(seqs, lens)):  # slot 4: request 0 again, alone
            _forward(m, cache, slot, seq, 0, n)
        _forward(m, cache, 4, seqs[0], 0, lens[0])
        for rows in (1, 4):
            alone = _forward(m, cache, 4, seqs[0], lens[0], lens[0] + rows)
            others = [(s, seqs[s], lens[s], rows if s == 1 else 1) for s in (1, 2, 3)]
            beside = _forward(m, cache, 0, seqs[0], lens[0], lens[0] + rows, others=others)
            out.append((alone, beside))
    return out


def test_w8a8_rows_are_computed_alike_alone_and_beside_others(w8a8_model, monkeypatch):
    """The prerequisite of W8A8 with speculation (#31): a request's W8A8 logits must not depend
    on the batch (a verify row must round as the same token's one-row decode does). INT8 GEMMs are
    exact; the float linears (wo_a, wo_b, the head, ...) are what varied. With plain nn.Linear
    (the small-M kernels) the one-row decode differs: caught."""
    from sglang_dsv4_ascend.layers import Linear

    for alone, beside in _alone_and_beside(w8a8_model):
        assert torch.equal(alone, beside)
    monkeypatch.setattr(Linear, "forward", torch.nn.Linear.forward)
    (alone, beside), _ = _alone_and_beside(w8a8_model)
    assert not torch.equal(alone, beside)


def test_fp32_rows_are_computed_alike_alone_and_beside_others(dsv4_model, monkeypatch):
    """The float model in fp32 too: the grouped MoE pads each expert's rows past the small-M
    kernels (an expert that one token routes to alone, or with others, gives that token the same
    bits). Without the padding (SMALL_M 1) the one-row decode differs: caught."""
    import sglang_dsv4_ascend.layers.moe as moe

    m = dsv4_model("flash")
    for alone, beside in _alone_and_beside(m):
        assert torch.equal(alone, beside)
    monkeypatch.setattr(moe, "SMALL_M", 1)
    assert any(not torch.equal(a, b) for a, b in _alone_and_beside(m))
