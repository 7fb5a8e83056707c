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
from ..ops.reference import Source, source_rows
from . import Linear
from .compressor import Compressor

# Peak working set of the batched selection: (rows x candidates x max(heads, dims)) elements per chunk.
SELECT_CHUNK_ELEMS = 1 << 24
_INVALID = torch.iinfo(torch.int64).min


def _order_keys(scores: torch.Tensor, j: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
    """int64 keys whose order is (score descending, entry number ascending): fp32 scores mapped to
    an order-preserving integer in the high 32 bits, 2^32 - 1 - j in the low ones. Lets top-k
    break ties by the lowest entry exactly, without a full sort; invisible entries get INT64_MIN."""
    bits = scores.float().contiguous().view(torch.int32).long()
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
    keys = (ordered << 32) | (0xFFFFFFFF - j)
    return keys.masked_fill(~ok, _INVALID)


# How equal index scores are ordered. ReLU makes exact ties (score 0: every head's q·k <= 0) common
# when there are few indexer heads. "lowest_index" (default): a stable order, earlier entries first,
# so the selection does not depend on how many entries the forward holds -> chunked prefill, decode
# and speculative verify select exactly what one full prefill selects. "torch_topk": torch.topk's
# unspecified, size-dependent order, which is what HF transformers and the official code do; only
# used to compare with HF bit-for-bit (HF's own cached and uncached paths disagree on ties).
TIE_BREAK = "lowest_index"


def _shared(groups_cpu, which: int, a: int, b: int):
    """The one table row rows a..b-1 share in source `which`, or None (several requests, or unknown).
    Host lists: a request's rows are contiguous, so equal ends mean one request."""
    if groups_cpu is None:
        return None
    g = groups_cpu[which]
    return g[a] if g[a] == g[b - 1] else None


def _pick(table, group, cols):
    """table[group[t], cols[t, i]] with out-of-range columns clamped (their picks are masked)."""
    if table.shape[1] == 0:
        return torch.zeros_like(cols)
    return table[group[:, None], cols.clamp(0, table.shape[1] - 1)]


class TopkCarry:
    """IndexCache: the top-k a group's source CSA layer selected in the current forward, handed to
    the group's other CSA layers (config.topk_source). Keyed by the forward (its plan, or its
    segment list) so a reusing layer can never attend with a selection from an earlier forward.
    Batched path: the two pool-less Sources of `select_batched`; per-segment path: one
    (indices, valid) per segment. Not a module: it holds no weights, only this forward's picks."""

    __slots__ = ("key", "picks")

    def __init__(self):
        self.key, self.picks = None, None

    def put(self, key, picks) -> None:
        self.key, self.picks = key, picks

    def take(self, key):
        if self.key is not key:
            raise RuntimeError("IndexCache: a reusing CSA layer ran before its group's source layer in this forward")
        return self.picks


class Indexer(nn.Module):
    def __init__(self, cfg, dtype=None, device=None):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ratio = 4
        self.wq_b = Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False, dtype=dtype, device=device)
        self.weights_proj = Linear(cfg.hidden_size, self.n_heads, bias=False, dtype=dtype, device=device)
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

    def select_batched(self, q, w, committed, fresh, rp, T: int, n_swa: int, groups_cpu=None):
        """Top entries of every query of a batched forward, as two attention sources.

        Candidates of row t: its request's committed entries j < L // 4 (`committed`, a Source
        over the entry store of index keys) and the entries this forward completed that the row
        can see (`fresh`, over the new index keys). Scores are computed in bounded chunks of rows
        and candidates and merged with a running top-k; ties go to the lowest entry (TIE_BREAK).
        Returns Sources over the layer's kv store (committed picks, rows offset by `n_swa`) and
        over this forward's fresh pool (picks of new entries, offset by T). `groups_cpu`: host
        lists (committed group, fresh group) of each row, so that a chunk of rows of one request
        reads its candidate keys once instead of once per row (a prefill chunk's case)."""
        n_com, n_new = rp.max_committed, rp.max_new
        k = min(self.topk, n_com + n_new)
        dev = q.device
        sel = torch.zeros(T, k, dtype=torch.long, device=dev)
        sel_ok = torch.zeros(T, k, dtype=torch.bool, device=dev)
        if k == 0 or T == 0:
            empty = Source(committed.pool, sel, None, rp.com_hi.new_zeros(T), rp.com_hi.new_zeros(T))
            return empty, empty
        j0 = rp.com_hi  # committed entries of each row's request
        budget = max(1, SELECT_CHUNK_ELEMS // max(self.n_heads, self.head_dim))
        rows_step = max(1, min(T, budget // max(1, min(n_com + n_new, 4096))))
        for a in range(0, T, rows_step):
            b = min(T, a + rows_step)
            best = torch.full((b - a, 0), _INVALID, dtype=torch.int64, device=dev)
            parts = [(committed, 0, n_com), (fresh, None, n_new)]
            if TIE_BREAK == "torch_topk":  # one unchunked top-k over every candidate in entry order
                cand = [
                    self._candidate_scores(q, w, src, a, b, 0, width, _shared(groups_cpu, i, a, b))
                    for i, (src, _, width) in enumerate(parts)
                ]
                scores = torch.cat([c[0] for c in cand], 1)
                jj = torch.cat(
                    [
                        torch.arange(n_com, device=dev).expand(b - a, -1),
                        j0[a:b, None] + torch.arange(n_new, device=dev),
                    ],
                    1,
                )
                ok = torch.cat([c[1] for c in cand], 1)
                pick = scores.masked_fill(~ok, float("-inf")).topk(k, dim=-1).indices
                sel[a:b], sel_ok[a:b] = jj.gather(1, pick), ok.gather(1, pick)
                continue
            for i, (src, base, width) in enumerate(parts):
                step = max(1, budget // (b - a))
                shared = _shared(groups_cpu, i, a, b)
                for c0 in range(0, width, step):
                    c1 = min(width, c0 + step)
                    scores, ok = self._candidate_scores(q, w, src, a, b, c0, c1, shared)
                    jj = torch.arange(c0, c1, device=dev)[None, :] + (0 if base == 0 else j0[a:b, None])
                    best = torch.cat([best, _order_keys(scores, jj, ok)], 1)
                    best = best.topk(min(k, best.shape[1]), dim=-1).values
            sel_ok[a:b] = best != _INVALID
            sel[a:b] = (0xFFFFFFFF - (best & 0xFFFFFFFF)).masked_fill(~sel_ok[a:b], 0)
        is_com = sel < j0[:, None]
        com_rows = _pick(committed.table, committed.group, sel)
        new_rows = _pick(fresh.table, fresh.group, sel - j0[:, None])
        zeros, full = j0.new_zeros(T), j0.new_full((T,), k)
        return (
            Source(None, com_rows, None, zeros, full, sel_ok & is_com, committed.div, n_swa),
            Source(None, new_rows, None, zeros, full, sel_ok & ~is_com, 1, T),
        )

    def _candidate_scores(self, q, w, src, a: int, b: int, c0: int, c1: int, shared=None):
        """Scores [b-a, c1-c0] of candidates c0..c1-1 of one source for rows a..b-1, and visibility.
        `shared`: the table row all these rows use (one request), read once; None: per row."""
        mask = None if src.mask is None else src.mask[:, c0:c1]  # a tree row's own branch (plan.py)
        part = Source(src.pool, src.table[:, c0:c1], src.group, src.lo - c0, src.hi - c0, mask, src.div, src.offset)
        rows, ok = source_rows(part, a, b)
        n = max(0, src.pool.shape[0] - 1)
        if shared is not None:
            keys = src.pool[(part.table[shared].long() // src.div + src.offset).clamp(0, n)].float()
            return self.scores(q[a:b], w[a:b], keys), ok
        keys = src.pool[rows.clamp(0, n)].float()
        s = F.relu(torch.einsum("thd,tjd->thj", q[a:b].float(), keys)) * self.head_dim**-0.5
        return (s * w[a:b].unsqueeze(-1)).sum(dim=1), ok
