"""Lightning indexer of CSA layers (reference §1.4 "CSA lightning indexer").

It owns a compressor at index_head_dim (same overlapping 4-token windows as the main CSA compressor)
whose entries are the index keys K^I_j. Per query token t:
    q^I = RoPE(W_I,qb q_lat) reshaped [n_I, c_I]        (q_lat = normed low-rank query of attention)
    w   = W_proj x * n_I^{-1/2}                         (per-head weights)
    I_{t,j} = sum_h w_h * ReLU(q^I_h · K^I_j) * c_I^{-1/2}
and the query attends to the top-min(index_topk, visible) entries among the visible j < (t+1)//4.
The official code also applies a Hadamard rotation and simulated FP4 to q^I/K^I (QAT emulation);
the rotation is orthogonal so it cancels in q·k, and FP4 emulation is not part of this bf16 model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from .compressor import Compressor

# How equal index scores are ordered. ReLU makes exact ties (score 0: every head's q·k <= 0) common
# when there are few indexer heads. "lowest_index" (default): a stable order, earlier entries first,
# so the selection does not depend on how many entries the forward holds -> chunked prefill, decode
# and speculative verify select exactly what one full prefill selects. "torch_topk": torch.topk's
# unspecified, size-dependent order, which is what HF transformers and the official code do; only
# used to compare with HF bit-for-bit (HF's own cached and uncached paths disagree on ties).
TIE_BREAK = "lowest_index"


class Indexer(nn.Module):
    def __init__(self, cfg, dtype=None, device=None):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = 4
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype, device=device)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False, dtype=dtype, device=device)
        self.compressor = Compressor(cfg, self.ratio, self.head_dim, dtype=dtype, device=device)

    def queries(self, q_lat: torch.Tensor, x: torch.Tensor, cos, sin):
        """Row-wise part for all tokens: (q^I [T, n_I, c_I] roped, head weights [T, n_I] fp32)."""
        q = self.wq_b(q_lat).unflatten(-1, (self.n_heads, self.head_dim))
        q = ops.apply_rope(q, cos, sin)
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return q, w

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """I[t, j] = sum_h w[t, h] * ReLU(q[t, h] . keys[j]) * c_I^{-1/2}, fp32 [T, n]."""
        s = F.relu(torch.einsum("thd,jd->thj", q.float(), keys.float())) * self.head_dim**-0.5
        return (s * w.unsqueeze(-1)).sum(dim=1)

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, positions: torch.Tensor):
        """Top entries per query: (indices [T, k], valid [T, k]) over keys [n, c_I], k = min(topk, n).

        A query with fewer than k visible entries gets its extra picks marked invalid."""
        n = keys.shape[0]
        visible = (positions + 1) // self.ratio  # entries j < visible are complete for the query
        if n == 0:
            empty = torch.zeros(q.shape[0], 0, dtype=torch.long, device=q.device)
            return empty, empty.bool()
        scores = self.scores(q, w, keys)
        future = torch.arange(n, device=q.device)[None, :] >= visible[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        k = min(self.topk, n)
        if TIE_BREAK == "torch_topk":
            idx = scores.topk(k, dim=-1).indices
        else:
            idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        return idx, idx < visible[:, None]
