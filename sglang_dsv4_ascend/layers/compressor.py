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
        xf = x.float()
        return F.linear(xf, self.wkv.weight.float()), F.linear(xf, self.wgate.weight.float())

    def first_needed_position(self, start: int) -> int:
        """Oldest position whose rows a forward starting at `start` must read back: the start of the
        incomplete block (and, for overlapping windows, of the block before it)."""
        block = self.ratio * (start // self.ratio)
        return max(0, block - self.ratio) if self.overlap else block

    def compress(self, kv_rows, gate_rows, base: int, j0: int, j1: int, rotary, out_dtype) -> torch.Tensor:
        """Entries j0..j1-1 from rows covering positions [base, base + len(rows)). -> [j1-j0, head_dim]."""
        r, D = self.ratio, self.head_dim
        n = j1 - j0
        if n <= 0:
            return kv_rows.new_zeros(0, D, dtype=out_dtype)
        j = torch.arange(j0, j1, device=kv_rows.device)
        cur = (j * r - base)[:, None] + torch.arange(r, device=kv_rows.device)  # [n, r] row indices
        ape = self.ape.float()
        if not self.overlap:
            kv, gate = kv_rows[cur], gate_rows[cur] + ape
        else:
            prev = cur - r
            has_prev = (j > 0)[:, None, None]
            kv_prev = kv_rows[prev.clamp(min=0)][..., :D]
            gate_prev = (gate_rows[prev.clamp(min=0)][..., :D] + ape[:, :D]).masked_fill(~has_prev, float("-inf"))
            kv = torch.cat([kv_prev, kv_rows[cur][..., D:]], dim=1)
            gate = torch.cat([gate_prev, gate_rows[cur][..., D:] + ape[:, D:]], dim=1)
        pooled = ops.softmax_pool(kv, gate)
        normed = ops.rms_norm(pooled, self.norm.weight.float(), self.norm.eps)
        cos, sin = rotary(j * r)  # an entry sits at the position of its block's first token
        return ops.apply_rope(normed, cos, sin).to(out_dtype)

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
