"""KV compressor (reference §1.4 "Compressor"): one entry per `ratio` tokens.

For token s: k_s = W_kv x_s, g_s = W_gate x_s + ape[s mod r] (fp32). Entry j summarizes block
[j*r, (j+1)*r) by a per-channel softmax pool over the gates:
* HCA (r = 128): C_j = sum_{s in block j} softmax_s(g_s) * k_s.
* CSA (r = 4), overlapping windows: W_kv / W_gate emit 2*D channels; entry j pools 2r slots, the
  previous block j-1 through the first D channels and block j through the last D channels. For j = 0
  the previous half does not exist and gets weight 0.
Then C_j <- RoPE(RMSNorm(C_j), position j*r). Entry j is complete (usable) once token (j+1)*r - 1
exists, i.e. a query at t sees j < (t+1) // r.

The projections are row-wise (`project`, batched over the whole forward); pooling (`compress`) needs
the rows of the incomplete blocks from earlier forwards, which the cache keeps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..ops.reference import pad_rows
from . import RMSNorm


class Compressor(nn.Module):
    def __init__(self, cfg, ratio: int, head_dim: int, dtype=None, device=None):
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, ratio == 4
        width = 2 * head_dim if self.overlap else head_dim
        self.wkv = nn.Linear(cfg.hidden_size, width, bias=False, dtype=dtype, device=device)
        self.wgate = nn.Linear(cfg.hidden_size, width, bias=False, dtype=dtype, device=device)
        self.ape = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32, device=device))
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps, dtype=dtype, device=device)

    def project(self, x: torch.Tensor):
        """(k, g) rows for every token, fp32 as in the official code. The ape is added at pooling."""
        # on padded rows (ops.reference.pad_rows), padded once for both projections: a row's
        # compressor state must not depend on how many rows its forward had (a verify's k rows vs
        # one-row decodes), or a bf16 server's output moves with speculation
        xf, rows = pad_rows(x.float()), x.shape[0]
        return F.linear(xf, self.wkv.weight.float())[:rows], F.linear(xf, self.wgate.weight.float())[:rows]

    def first_needed_position(self, start: int) -> int:
        """Oldest position whose rows a forward starting at `start` must read back: the start of the
        incomplete block (and, for overlapping windows, of the block before it)."""
        block = self.ratio * (start // self.ratio)
        return max(0, block - self.ratio) if self.overlap else block

    def block_positions(self, j: torch.Tensor) -> torch.Tensor:
        """[n, Lb] positions entry j pools: with overlap the previous block then its own (2r),
        otherwise its own block (r)."""
        r = self.ratio
        first = j * r - (r if self.overlap else 0)
        return first[:, None] + torch.arange(2 * r if self.overlap else r, device=j.device)

    def entries_from_blocks(self, kv, gate, ok, j: torch.Tensor, rotary, out_dtype) -> torch.Tensor:
        """Entries from their gathered block rows: kv/gate [n, Lb, C] fp32 (`block_positions`
        order), ok [n, Lb] False where a row does not exist (the previous block of entry 0).
        -> [n, head_dim]: pooled, RMS-normed, roped at position j * r."""
        if j.shape[0] == 0:
            return kv.new_zeros(0, self.head_dim, dtype=out_dtype)
        return self._finish(ops.pool_block_rows(kv, gate, ok, self.ape, self.overlap), j, rotary, out_dtype)

    def _finish(self, pooled, j, rotary, out_dtype):
        normed = ops.rms_norm(pooled, self.norm.weight.float(), self.norm.eps)
        cos, sin = rotary(j * self.ratio)  # an entry sits at the position of its block's first token
        return ops.apply_rope(normed, cos, sin).to(out_dtype)

    def compress(self, kv_rows, gate_rows, base: int, j0: int, j1: int, rotary, out_dtype) -> torch.Tensor:
        """Entries j0..j1-1 from rows covering positions [base, base + len(rows)). -> [j1-j0, head_dim]."""
        j = torch.arange(j0, max(j0, j1), device=kv_rows.device)
        pos = self.block_positions(j)
        ok = pos >= 0
        idx = (pos - base).clamp(min=0)
        return self.entries_from_blocks(kv_rows[idx], gate_rows[idx], ok, j, rotary, out_dtype)

    def pool_batched(self, rows_new, ring, rp, rotary, out_dtype) -> torch.Tensor:
        """Every entry the forward completes (plan.RatioPlan `rp`), all segments at once: block rows
        from the committed ring (`ring` = (kv, gate) [S, Rc, C]) or this forward's `rows_new`."""
        if rp.n_new == 0:
            return rows_new[0].new_zeros(0, self.head_dim, dtype=out_dtype)
        kv_new, gate_new = rows_new
        ring_kv, ring_gate = (t.flatten(0, 1) for t in ring)
        # Rows that do not exist (before position 0) get weight 0 and are zeroed first: 0 * garbage
        # (a never-written ring row may hold NaN) must stay 0.
        pooled = ops.block_pool(
            ring_kv,
            ring_gate,
            kv_new,
            gate_new,
            rp.blk_ring,
            rp.blk_fresh,
            rp.blk_from_ring,
            rp.blk_ok,
            self.ape,
            self.overlap,
        )
        return self._finish(pooled, rp.ent_j, rotary, out_dtype)

    def segment_entries(self, rows_new, start: int, read_rows, rotary, out_dtype):
        """Entries completed by the tokens [start, start + n) of one request.

        rows_new: (kv, gate) of the new tokens; read_rows(p0, p1) returns the cached rows of earlier
        positions. Returns (j0, entries [m, D]) with m = (start+n)//r - start//r."""
        kv_new, gate_new = rows_new
        base = self.first_needed_position(start)
        if base < start:
            kv_old, gate_old = read_rows(base, start)
            kv_new, gate_new = torch.cat([kv_old, kv_new]), torch.cat([gate_old, gate_new])
        j0, j1 = start // self.ratio, (start + rows_new[0].shape[0]) // self.ratio
        return j0, self.compress(kv_new, gate_new, base, j0, j1, rotary, out_dtype)
