"""The Triton compressor-pooling kernel (`block_pool`) equals the reference, run by Triton's
interpreter on CPU (TRITON_INTERPRET must be set before triton is imported, hence the
subprocess): CSA (overlapping windows, entry 0 without a previous block) and HCA, rows from the
ring and from the forward mixed, NaN in rows that must never be read; a kernel that ignores the
overlap's channel halves is caught."""

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import torch
    from sglang_dsv4_ascend.ops.reference import block_pool as ref
    from sglang_dsv4_ascend.ops.triton import compress_pool as tp

    torch.manual_seed(0)
    worst, broken = 0.0, []
    for r, overlap, D, E in [(4, True, 64, 5), (4, True, 96, 3), (128, False, 64, 2)]:
        C, LB = (2 * D, 2 * r) if overlap else (D, r)
        S_rows, T = 40 + LB, 3 * LB
        ring_kv, ring_gate = torch.randn(S_rows, C), torch.randn(S_rows, C) * 3
        new_kv, new_gate = torch.randn(T, C), torch.randn(T, C) * 3
        ape = torch.randn(r, C)
        blk_ring = torch.randint(0, S_rows, (E, LB))
        blk_fresh = torch.randint(0, T, (E, LB))
        from_ring = torch.rand(E, LB) > 0.5
        ok = torch.ones(E, LB, dtype=torch.bool)
        if overlap:
            ok[0, :r] = False  # entry 0: no previous block
        # rows never read hold NaN: the other source of each row, and rows that do not exist
        used_ring = set(blk_ring[from_ring & ok].tolist())
        keep = torch.tensor([i in used_ring for i in range(S_rows)])
        ring_kv[~keep], ring_gate[~keep] = float("nan"), float("nan")
        used_new = set(blk_fresh[~from_ring & ok].tolist())
        keep = torch.tensor([i in used_new for i in range(T)])
        new_kv[~keep], new_gate[~keep] = float("nan"), float("nan")
        args = (ring_kv, ring_gate, new_kv, new_gate, blk_ring, blk_fresh, from_ring, ok, ape, overlap)
        clean = [torch.nan_to_num(a) if a.is_floating_point() else a for a in args[:4]] + list(args[4:])
        a, b = ref(*clean), tp.block_pool(*args)
        assert torch.isfinite(b).all()
        worst = max(worst, (a - b).abs().max().item())
        if overlap:  # broken: the previous block pooled through the own block's channels
            wrong = ref(*clean[:8], torch.cat([ape[:, D:], ape[:, D:]], 1), overlap)
            broken.append((wrong - b).abs().max().item())
    print(worst, min(broken))
""")


def test_triton_block_pool_matches_reference_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    worst, broken = map(float, r.stdout.split())
    assert worst < 1e-5
    assert broken > 1e-3
