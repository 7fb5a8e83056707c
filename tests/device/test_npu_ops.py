"""torch_npu implementations of the model's hot ops vs the reference. Skipped unless torch_npu is
installed (never on CPU machines); this project has not run it on an NPU yet."""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.device,
    pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None, reason="needs torch_npu (Ascend NPU)"),
]


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_reference(with_weight):
    from sglang_dsv4_ascend.ops import npu, reference

    x = torch.randn(37, 512, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(512)).to(torch.bfloat16) if with_weight else None
    want = reference.rms_norm(x, w, 1e-6).float()
    got = npu.rms_norm(x.npu(), None if w is None else w.npu(), 1e-6).cpu().float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.fixture(scope="module")
def npu_ops():
    import torch_npu  # noqa: F401  (registers the npu device)

    if not torch.npu.is_available():
        pytest.skip("torch_npu installed but no NPU visible")
    from sglang_dsv4_ascend.ops import npu

    return npu


def _close_to_reference(got, want):
    """bf16 through npu_fused_infer_attention_score (out rounded to bf16, then the fp32 sink
    correction, rounded again) vs the fp32 reference on the same bf16 inputs."""
    got, want = got.cpu().float(), want.float()
    assert not torch.isnan(got).any()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()


@pytest.mark.parametrize("H", [64, 128])  # 128: two calls of 64 heads (num_heads / kv heads <= 64)
def test_sparse_attention_with_sink_matches_reference(npu_ops, H):
    """npu_fused_infer_attention_score + sink correction vs the reference at DeepSeek-V4's D = 512:
    ragged valid masks, a row with no valid key (must be exactly 0), NaN pool rows behind invalid
    keys, several chunks."""
    from sglang_dsv4_ascend.ops import reference

    g = torch.Generator().manual_seed(0)
    T, D, N, K = 37, 512, 300, 200
    q = torch.randn(T, H, D, generator=g).bfloat16()
    pool = torch.randn(N + 1, D, generator=g).bfloat16()
    pool[N] = float("nan")
    idx = torch.randint(0, N, (T, K), generator=g)
    valid = torch.rand(T, K, generator=g) > 0.3
    valid[3] = False
    idx[~valid] = N
    sink = torch.randn(H, generator=g) * 2
    scale = D**-0.5
    want = reference.sparse_attention_with_sink(q, pool, idx, valid, sink, scale)
    dev = [t.to("npu") for t in (q, pool, idx, valid, sink)]
    got = npu_ops.sparse_attention_with_sink(*dev, scale, max_chunk_elems=10 * K * D)
    assert got.dtype == torch.bfloat16 and torch.all(got[3].cpu() == 0)
    _close_to_reference(got, want)


def test_sparse_attention_sources_matches_reference(npu_ops):
    """The batched attention's op (keys of several Sources: per-row and per-request tables, a
    mask, a strided slot map) through npu_fused_infer_attention_score vs the reference."""
    from sglang_dsv4_ascend.ops import reference
    from sglang_dsv4_ascend.ops.reference import Source

    g = torch.Generator().manual_seed(1)
    T, H, D, N, M = 24, 64, 512, 400, 50
    q = torch.randn(T, H, D, generator=g).bfloat16()
    A, B = torch.randn(N, D, generator=g).bfloat16(), torch.randn(M, D, generator=g).bfloat16()
    sink = torch.randn(H, generator=g) * 2
    G = torch.arange(T) * 3 // T
    z = torch.zeros(T, dtype=torch.long)
    lo = torch.randint(0, 20, (T,), generator=g)
    hi = lo + torch.randint(0, 100, (T,), generator=g)
    hi[5], lo[5] = 0, 0
    srcs = [
        Source(A, torch.randint(0, N, (T, 128), generator=g), None, lo, hi.clamp(max=128)),
        Source(
            B,
            torch.randint(0, M, (3, 40), generator=g),
            G,
            z,
            torch.randint(0, 41, (T,), generator=g),
            torch.rand(T, 40, generator=g) > 0.2,
        ),
        Source(
            A,
            torch.randint(0, 4 * 64, (3, 64), generator=g),
            G,
            z,
            torch.randint(0, 65, (T,), generator=g),
            None,
            4,
            100,
        ),
    ]
    srcs[1].hi[5] = 0
    srcs[2].hi[5] = 0

    def on(dev):
        return [
            Source(
                s.pool.to(dev),
                s.table.to(dev),
                None if s.group is None else s.group.to(dev),
                s.lo.to(dev),
                s.hi.to(dev),
                None if s.mask is None else s.mask.to(dev),
                s.div,
                s.offset,
            )
            for s in srcs
        ]

    want = reference.sparse_attention_sources(q, srcs, sink, D**-0.5)
    got = npu_ops.sparse_attention_sources(q.to("npu"), on("npu"), sink.to("npu"), D**-0.5, max_chunk_elems=8 * 232 * D)
    assert torch.all(got[5].cpu() == 0)
    _close_to_reference(got, want)
