"""The Triton sparse-attention-with-sink kernel equals the reference, run by Triton's interpreter
on CPU (TRITON_INTERPRET must be set before triton is imported, hence the subprocess)."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from sglang_dsv4_ascend.ops.reference import sparse_attention_with_sink as ref
    from sglang_dsv4_ascend.ops.triton.sparse_attention import sparse_attention_with_sink as tri

    torch.manual_seed(0)
    worst, sink_effect = 0.0, []
    # (T, H, D, N, K): heads below/above one 16-head block, K not a multiple of the block,
    # D = 512 as in DeepSeek-V4, rows with no valid key at all.
    for T, H, D, N, K in [(5, 4, 64, 50, 20), (3, 20, 128, 40, 33), (2, 16, 512, 300, 70), (4, 4, 64, 10, 1)]:
        q, kv = torch.randn(T, H, D), torch.randn(N, D)
        idx = torch.randint(0, N, (T, K))
        valid = torch.rand(T, K) > 0.3
        valid[0] = False
        idx[~valid] = 10 ** 6  # garbage where invalid must never be read
        sink = torch.randn(H) * 2
        a, b = ref(q, kv, idx, valid, sink, D ** -0.5), tri(q, kv, idx, valid, sink, D ** -0.5)
        assert torch.all(b[0] == 0), "a query with no valid key must give 0"
        worst = max(worst, (a - b).abs().max().item())
        # Broken variant (sink left out of the denominator) must differ: the test is sensitive.
        no_sink = ref(q, kv, idx, valid, torch.full((H,), -1e30), D ** -0.5)
        sink_effect.append((no_sink - b)[1:].abs().max().item())
        bf = tri(q.bfloat16(), kv.bfloat16(), idx, valid, sink, D ** -0.5)
        assert bf.dtype == torch.bfloat16
        assert (bf.float() - ref(q.bfloat16(), kv.bfloat16(), idx, valid, sink, D ** -0.5).float()).abs().max() < 0.05
    print(worst, min(sink_effect))
""")


def test_triton_kernel_matches_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    worst, sink_effect = map(float, r.stdout.split())
    assert worst < 1e-5
    assert sink_effect > 1e-3


SOURCES_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from sglang_dsv4_ascend import ops
    from sglang_dsv4_ascend.ops import reference
    from sglang_dsv4_ascend.ops.reference import Source
    from sglang_dsv4_ascend.ops.triton import sparse_attention as tri

    torch.manual_seed(0)
    T, H, D, N, M = 6, 20, 64, 80, 9
    q, A, B = torch.randn(T, H, D), torch.randn(N, D), torch.randn(M, D)
    sink = torch.randn(H)
    G = torch.tensor([0, 0, 1, 1, 1, 2])  # rows grouped by request
    lo, hi = torch.randint(0, 3, (T,)), torch.randint(3, 12, (T,))
    srcs = [
        Source(A, torch.randint(0, N, (T, 12)), None, lo, hi),                          # per-row table
        Source(B, torch.randint(0, M, (3, 5)), G, torch.zeros(T, dtype=torch.long),    # per-group table
               torch.tensor([5, 5, 2, 2, 0, 1]), torch.rand(T, 5) > 0.2),
        Source(A, torch.randint(0, 4 * 10, (3, 10)), G, torch.zeros(T, dtype=torch.long),
               torch.tensor([10, 4, 7, 7, 0, 10]), None, 4, 40),                         # strided slot map
    ]
    a = reference.sparse_attention_sources(q, srcs, sink, D ** -0.5)
    b = tri.sparse_attention_sources(q, srcs, sink, D ** -0.5)
    worst = (a - b).abs().max().item()
    # Broken variant: the second pool's rows read from the first pool must differ.
    wrong = [s._replace(pool=A) if s.pool is B else s for s in srcs]
    broken = (reference.sparse_attention_sources(q, wrong, sink, D ** -0.5) - b).abs().max().item()

    # The batched forward of the tiny model with this kernel == with the reference op.
    from sglang_dsv4_ascend.models.weights import load_model_from_dir
    from sglang_dsv4_ascend.batch import Segment
    model = load_model_from_dir(sys.argv[1])
    def logits(op):
        ops.sparse_attention_sources = op
        cache = model.make_cache(2, 300, spec_slack=2)
        model(torch.arange(140) % 1000, torch.arange(140), [Segment(0, 0, 140)], cache)
        segs = [Segment(0, 140, 3), Segment(1, 0, 6)]
        pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in segs])
        return model.compute_logits(model(torch.arange(9) * 11 % 1000, pos, segs, cache))
    model_diff = (logits(reference.sparse_attention_sources) - logits(tri.sparse_attention_sources)).abs().max().item()
    print(worst, broken, model_diff)
""")


def test_triton_two_pool_kernel_matches_the_sources_reference(tiny_ckpt):
    """The batched attention's kernel (keys of several Sources over two pools, one launch) equals
    ops.reference.sparse_attention_sources on random sources (per-row and per-request tables,
    masks, a strided slot map) and inside the tiny model's batched forward (logits)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run(
        [sys.executable, "-c", SOURCES_SCRIPT, tiny_ckpt("flash")], capture_output=True, text=True, env=env, timeout=900
    )
    assert r.returncode == 0, r.stderr[-3000:]
    worst, broken, model_diff = map(float, r.stdout.split()[-3:])
    assert worst < 1e-5 and model_diff < 1e-4
    assert broken > 1e-3
