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
