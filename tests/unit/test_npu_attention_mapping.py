"""The torch_npu mapping of the batched sparse attention (ops/npu.py: npu_fused_infer_attention_score
+ the sink correction) against the reference, on CPU, through a FAKE torch_npu.

The fake op below is written from the op's documentation (Ascend/op-plugin
docs/context/torch_npu-npu_fused_infer_attention_score.md), not from ops/reference.py:
* out = softmax(scale * q . k^T over the keys not masked) . v, per query head, head n reading KV
  head n // (num_heads / num_key_value_heads); BSND in, BSND out, in the query's dtype;
* atten_mask bool / int8 / uint8, True (non-zero) = masked;
* softmax_lse = log(sum exp(s - max)) + max over the unmasked scaled scores, fp32,
  shape (B, N, Q_S, 1) (the fixture also runs the (B, Q_S, N, 1) reading);
* the documented limits are enforced (BSND, N <= 256, num_heads / num_key_value_heads <= 64,
  D <= 512, B <= 65536, contiguous inputs, mask shape / dtype, query dtype in npu.FIA_DTYPES);
* a row whose keys are all masked is unspecified for Q_S = 1, so the fake returns NaN there
  (out and lse): the mapping must not depend on it.
What this cannot tell: whether the real op behaves as documented. That needs an NPU
(tests/device/test_npu_ops.py)."""

import os
import subprocess
import sys
import textwrap
import types

import pytest
import torch

from sglang_dsv4_ascend.ops import npu, reference
from sglang_dsv4_ascend.ops.reference import Source

TOL = 1e-5  # fp32, the same math in another order
_FIA_KWARGS = {  # the op's keyword arguments (documented signature)
    "pse_shift",
    "atten_mask",
    "actual_seq_lengths",
    "actual_seq_lengths_kv",
    "dequant_scale1",
    "quant_scale1",
    "dequant_scale2",
    "quant_scale2",
    "quant_offset2",
    "antiquant_scale",
    "antiquant_offset",
    "block_table",
    "query_padding_size",
    "kv_padding_size",
    "key_antiquant_scale",
    "key_antiquant_offset",
    "value_antiquant_scale",
    "value_antiquant_offset",
    "key_shared_prefix",
    "value_shared_prefix",
    "actual_shared_prefix_len",
    "query_rope",
    "key_rope",
    "key_rope_antiquant_scale",
    "num_heads",
    "scale",
    "pre_tokens",
    "next_tokens",
    "input_layout",
    "num_key_value_heads",
    "sparse_mode",
    "inner_precise",
    "block_size",
    "antiquant_mode",
    "softmax_lse_flag",
    "key_antiquant_mode",
    "value_antiquant_mode",
}


def fake_fused_infer_attention_score(query, key, value, *, lse_layout="BNS1", calls=None, **kw):
    """Plain-torch npu_fused_infer_attention_score for the BSND, no-quant, no-paging case."""
    assert set(kw) <= _FIA_KWARGS, f"not a keyword of the op: {set(kw) - _FIA_KWARGS}"
    layout, N = kw.get("input_layout", "BSH"), kw.get("num_heads", 1)
    KVN = kw.get("num_key_value_heads", 0) or N
    assert layout == "BSND", layout
    assert query.dtype in npu.FIA_DTYPES and key.dtype == value.dtype == query.dtype
    assert query.is_contiguous() and key.is_contiguous() and value.is_contiguous()
    B, S, qn, D = query.shape
    _, S2, kn, Dk = key.shape
    assert value.shape == key.shape and key.shape[0] == B and Dk == D
    assert qn == N and kn == KVN and N % KVN == 0 and N // KVN <= 64 and N <= 256
    assert D <= 512 and B <= 65536
    mask = kw.get("atten_mask")
    if calls is not None:
        calls.append(dict(B=B, N=N, K=S2, scale=kw.get("scale", 1.0)))
    s = torch.einsum("bsnd,btnd->bnst", query.double(), key.double().repeat_interleave(N // KVN, dim=2))
    s = s * kw.get("scale", 1.0)
    if mask is not None:
        assert mask.dtype in (torch.bool, torch.int8, torch.uint8) and mask.is_contiguous()
        if S == 1:
            assert tuple(mask.shape) in ((B, S2), (B, 1, S2), (B, 1, 1, S2)), mask.shape
        else:
            assert tuple(mask.shape[-2:]) == (S, S2), mask.shape
        s = s.masked_fill(mask.reshape(B, 1, S, S2).bool(), float("-inf"))
    m = s.amax(dim=-1, keepdim=True)
    e = torch.exp(s - m)
    total = e.sum(dim=-1, keepdim=True)
    out = torch.einsum("bnst,btnd->bsnd", e / total, value.double().repeat_interleave(N // KVN, dim=2))
    lse = torch.log(total) + m  # [B, N, S, 1]; -inf - (-inf) = NaN where a row is all masked
    dead = torch.isinf(m)
    out = out.masked_fill(dead.permute(0, 2, 1, 3), float("nan"))
    lse = lse.masked_fill(dead, float("nan"))
    if not kw.get("softmax_lse_flag", False):
        lse = torch.zeros(1)
    elif lse_layout == "BSN1":
        lse = lse.permute(0, 2, 1, 3).contiguous()
    return out.to(query.dtype), lse.float()


@pytest.fixture(params=["BNS1", "BSN1"])
def fake_npu(request, monkeypatch):
    """A fake torch_npu in sys.modules; returns the list of recorded op calls. The query dtypes
    the mapping sends to the op are widened to fp32 so the comparison can be tight."""
    calls = []
    mod = types.ModuleType("torch_npu")
    mod.npu_fused_infer_attention_score = lambda *a, **kw: fake_fused_infer_attention_score(
        *a, lse_layout=request.param, calls=calls, **kw
    )
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    monkeypatch.setattr(npu, "FIA_DTYPES", (torch.float16, torch.bfloat16, torch.float32))
    return calls


# ------------------------------------------------------------------------------------------------
# inputs


def random_sources(T=11, H=5, D=32, N=60, M=9, seed=0, dtype=torch.float32):
    """q, sources, sink for `sparse_attention_sources`: a per-row table with ragged [lo, hi), a
    per-request table with a mask, a strided slot map (div, offset), an empty table; rows 0 and 5
    have no valid key; invalid table entries point out of range."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    A, B = torch.randn(N, D, generator=g).to(dtype), torch.randn(M, D, generator=g).to(dtype)
    sink = torch.randn(H, generator=g) * 2
    G = torch.arange(T) * 3 // T  # rows grouped into 3 requests
    lo = torch.randint(0, 4, (T,), generator=g)
    hi = lo + torch.randint(0, 9, (T,), generator=g)
    per_row = torch.randint(0, N, (T, 12), generator=g)
    per_row[torch.arange(12)[None, :] >= hi[:, None]] = 10**6  # garbage past hi
    z = torch.zeros(T, dtype=torch.long)
    hi_b, hi_c = torch.randint(0, 6, (T,), generator=g), torch.randint(0, 11, (T,), generator=g)
    for row in (0, 5):
        lo[row], hi[row], hi_b[row], hi_c[row] = 3, 3, 0, 0
    sources = [
        Source(A, per_row, None, lo, hi),
        Source(B, torch.randint(0, M, (3, 5), generator=g), G, z, hi_b, torch.rand(T, 5, generator=g) > 0.25),
        Source(A, torch.randint(0, 4 * 10, (3, 10), generator=g), G, z, hi_c, None, 4, 40),
        Source(B, torch.zeros(3, 0, dtype=torch.long), G, z, z),
    ]
    return q, sources, sink


def random_single_pool(T=9, H=5, D=32, N=40, K=17, seed=1, dtype=torch.float32):
    """q, kv_pool, indices, valid, sink for `sparse_attention_with_sink`; the pool's last row is NaN
    and every invalid key points at it; row 0 has no valid key."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, D, generator=g).to(dtype)
    pool = torch.randn(N + 1, D, generator=g).to(dtype)
    pool[N] = float("nan")
    idx = torch.randint(0, N, (T, K), generator=g)
    valid = torch.rand(T, K, generator=g) > 0.4
    valid[0] = False
    idx[~valid] = N
    return q, pool, idx, valid, torch.randn(H, generator=g) * 2


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


# ------------------------------------------------------------------------------------------------
# the mapping == the reference


@pytest.mark.parametrize("H", [5, 70])  # 70: two calls per chunk (64 + 6 heads)
@pytest.mark.parametrize("max_chunk_elems", [1 << 24, 2600])  # one chunk; 1-3 rows a chunk
def test_sources_mapping_matches_reference(fake_npu, H, max_chunk_elems):
    q, sources, sink = random_sources(H=H)
    want = reference.sparse_attention_sources(q, sources, sink, 0.17, max_chunk_elems)
    got = npu.sparse_attention_sources(q, sources, sink, 0.17, max_chunk_elems)
    assert _err(got, want) < TOL
    assert torch.all(got[[0, 5]] == 0), "a row with no valid key gives 0 (the fake gives NaN there)"
    assert fake_npu and all(c["N"] <= 64 and c["scale"] == 0.17 for c in fake_npu)
    K = sum(s.table.shape[-1] for s in sources)
    assert all(c["K"] == K for c in fake_npu)
    rows = sum(c["B"] for c in fake_npu)
    assert rows == q.shape[0] * (1 if H <= 64 else 2)
    if max_chunk_elems < 1 << 24:
        step = max(1, max_chunk_elems // (K * max(q.shape[2], H)))
        assert max(c["B"] for c in fake_npu) == step and len(fake_npu) > 2


@pytest.mark.parametrize("max_chunk_elems", [1 << 24, 1200])
def test_single_pool_mapping_matches_reference(fake_npu, max_chunk_elems):
    q, pool, idx, valid, sink = random_single_pool()
    want = reference.sparse_attention_with_sink(q, pool, idx, valid, sink, 0.3, max_chunk_elems)
    got = npu.sparse_attention_with_sink(q, pool, idx, valid, sink, 0.3, max_chunk_elems)
    assert not torch.isnan(got).any(), "NaN pool rows behind invalid keys must not leak"
    assert _err(got, want) < TOL
    assert torch.all(got[0] == 0)
    assert len(fake_npu) == (1 if max_chunk_elems == 1 << 24 else -(-q.shape[0] // (1200 // (17 * 32))))


def test_degenerate_shapes(fake_npu):
    """No query rows, no keys at all (only empty sources / K = 0): zeros, the op not called."""
    q, sources, sink = random_sources()
    assert npu.sparse_attention_sources(q[:0], sources, sink, 0.1).shape == (0, 5, 32)
    out = npu.sparse_attention_sources(q, [sources[3]], sink, 0.1)
    assert torch.equal(out, reference.sparse_attention_sources(q, [sources[3]], sink, 0.1)) and not out.any()
    q1, pool, idx, valid, sink1 = random_single_pool()
    out = npu.sparse_attention_with_sink(q1, pool, idx[:, :0], valid[:, :0], sink1, 0.1)
    assert not out.any() and not fake_npu


def test_dtypes_the_op_does_not_take_run_the_reference(monkeypatch):
    """With the documented dtypes (fp16 / bf16), an fp32 q runs the reference (the op is not
    called); a bf16 q goes through the op and stays within bf16 rounding of the reference."""
    calls = []
    mod = types.ModuleType("torch_npu")
    mod.npu_fused_infer_attention_score = lambda *a, **kw: fake_fused_infer_attention_score(*a, calls=calls, **kw)
    monkeypatch.setitem(sys.modules, "torch_npu", mod)
    q, sources, sink = random_sources()
    assert torch.equal(
        npu.sparse_attention_sources(q, sources, sink, 0.2), reference.sparse_attention_sources(q, sources, sink, 0.2)
    )
    assert not calls
    qb, sb, _ = random_sources(dtype=torch.bfloat16)
    got = npu.sparse_attention_sources(qb, sb, sink, 0.2)
    want = reference.sparse_attention_sources(qb, sb, sink, 0.2)
    assert calls and got.dtype == torch.bfloat16
    assert _err(got, want) < 2e-2 * want.float().abs().max().item()


# ------------------------------------------------------------------------------------------------
# the comparison catches broken mappings


_CORRECTION = npu._with_sink  # the mapping's own sink correction, before any test patches it


def _no_sink(out, lse, sink):
    return out.float()


def _sink_sign_flipped(out, lse, sink):
    return out.float() * torch.sigmoid(sink - lse.float())[..., None]


def _lse_wrong_axis(out, lse, sink):
    t, h = lse.shape
    return _CORRECTION(out, lse.reshape(h, t).t(), sink)


def _lse_as_log2(out, lse, sink):
    return _CORRECTION(out, lse / torch.log(torch.tensor(2.0)), sink)


def _mask_polarity_inverted(ok):
    return ok.reshape(ok.shape[0], 1, 1, ok.shape[1]).contiguous()


BROKEN = {
    "no sink correction": ("_with_sink", _no_sink),
    "sigmoid(s - lse)": ("_with_sink", _sink_sign_flipped),
    "lse read as [h, t]": ("_with_sink", _lse_wrong_axis),
    "lse taken as log2": ("_with_sink", _lse_as_log2),
    "mask polarity inverted": ("_key_mask", _mask_polarity_inverted),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_broken_mappings_are_caught(fake_npu, monkeypatch, name):
    """Each broken variant, run through the same comparison as the tests above, fails it."""
    attr, broken = BROKEN[name]
    monkeypatch.setattr(npu, attr, broken)
    q, sources, sink = random_sources(T=13, H=7)
    want = reference.sparse_attention_sources(q, sources, sink, 0.17)
    got = npu.sparse_attention_sources(q, sources, sink, 0.17)
    err = _err(torch.nan_to_num(got, nan=1e9), want)
    assert err > 1e3 * TOL, f"{name}: max error {err} would pass the comparison"


# ------------------------------------------------------------------------------------------------
# import discipline


def test_importing_the_npu_module_never_imports_torch_npu(tmp_path):
    """With a torch_npu on the path that fails when imported, `ops` binds the npu family (its
    spec is found) and ops.npu imports, but torch_npu is never executed."""
    (tmp_path / "torch_npu.py").write_text("raise RuntimeError('torch_npu was imported')\n")
    code = textwrap.dedent("""
        import sys
        import sglang_dsv4_ascend.ops.npu
        from sglang_dsv4_ascend import ops
        assert ops.KERNEL_FAMILY == "npu", ops.KERNEL_FAMILY
        assert ops.sparse_attention_sources.__module__.endswith("ops.npu")
        assert ops.sparse_attention_with_sink.__module__.endswith("ops.npu")
        assert "torch_npu" not in sys.modules
        print("ok")
    """)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(tmp_path), os.getcwd(), os.environ.get("PYTHONPATH", "")]),
        "SGLANG_DSV4_FORCE_REFERENCE": "0",
    }
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-3000:]
