"""Independent definitions for DSpark: the verify planner by brute force over the paper's
formulas, and the draft block by dense per-request attention (no rings, no index lists)."""

from __future__ import annotations

import torch


def oracle_budget(lagged_conf, cost) -> int:
    """K = argmax_k (R + sum of the k largest lagged survivals) / t(R, R + k), smallest k on ties;
    with no cost model every candidate. lagged_conf: list of per-request confidence lists."""
    R = len(lagged_conf)
    surv = []
    for row in lagged_conf:
        a = 1.0
        for c in row:
            a *= min(1.0, max(0.0, float(c)))
            surv.append(a)
    if cost is None:
        return sum(len(r) for r in lagged_conf)
    cands = sorted((s for s in surv if s >= 1e-6), reverse=True)
    best_k, best = 0, None
    total = 0.0
    for k in range(len(cands) + 1):
        if k:
            total += cands[k - 1]
        theta = (R + total) / cost(R, R + k)
        if best is None or theta > best:
            best_k, best = k, theta
    return best_k


def oracle_select(conf, K: int) -> list:
    """Per request the number of drafts among the global top-K by (survival desc, position asc,
    request asc)."""
    items = []
    for r, row in enumerate(conf):
        a = 1.0
        for j, c in enumerate(row):
            a *= min(1.0, max(0.0, float(c)))
            if a >= 1e-6:
                items.append((a, j, r))
    items.sort(key=lambda x: (-x[0], x[1], x[2]))
    lens = [0] * len(conf)
    for _, _, r in items[:K]:
        lens[r] += 1
    return lens


def _attend(q, keys, sink, scale):
    """q [n, H, D], keys [m, D] (key = value), sink [H] -> [n, H, D], dense softmax with sink."""
    logits = torch.einsum("nhd,md->nhm", q.float(), keys.float()) * scale
    m = torch.maximum(logits.amax(-1), sink.float()[None])
    w = torch.exp(logits - m[..., None])
    den = w.sum(-1) + torch.exp(sink.float()[None] - m)
    return (torch.einsum("nhm,md->nhd", w, keys.float()) / den[..., None]).to(q.dtype)


@torch.no_grad()
def oracle_block(draft, feats, L: int, anchor: int, gamma: int, embed, head):
    """One request's base logits [gamma, V] and confidence features [gamma, d]: `feats` [L, d]
    are the target features of positions 0..L-1; each stage attends densely to the context K/V of
    positions max(0, L - W) .. L - 1 (computed from feats here) and to the whole block."""
    from sglang_dsv4_ascend import ops
    from sglang_dsv4_ascend.layers.mhc import hc_head, hc_post, hc_pre

    cfg = draft.cfg
    W = cfg.sliding_window
    ctx_pos = torch.arange(max(0, L - W), L)
    ids = torch.tensor([anchor] + [cfg.dspark_noise_token_id] * (gamma - 1))
    pos = torch.arange(L, L + gamma)
    x = embed(ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    for stage in draft.mtp:
        a = stage.attn
        cos_c, sin_c = a.rotary(ctx_pos)
        ctx_kv = ops.apply_rope(a.kv_norm(a.wkv(feats[ctx_pos])), cos_c, sin_c)
        y, post, comb = hc_pre(x, stage.hc_attn_fn, stage.hc_attn_base, stage.hc_attn_scale, cfg)
        h = stage.attn_norm(y)
        cos, sin = a.rotary(pos)
        q = a.wq_b(a.q_norm(a.wq_a(h))).unflatten(-1, (a.n_heads, a.head_dim))
        q = ops.apply_rope(ops.rms_norm(q, None, a.eps), cos, sin)
        blk_kv = ops.apply_rope(a.kv_norm(a.wkv(h)), cos, sin)
        o = _attend(q, torch.cat([ctx_kv, blk_kv]), a.attn_sink, a.head_dim**-0.5)
        x = hc_post(x, a._finish(o, cos, sin), post, comb)
        y, post, comb = hc_pre(x, stage.hc_ffn_fn, stage.hc_ffn_base, stage.hc_ffn_scale, cfg)
        x = hc_post(x, stage.ffn(stage.ffn_norm(y), ids), post, comb)
    last = draft.mtp[-1]
    hk = hc_head(x, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, cfg)
    return torch.nn.functional.linear(last.norm(hk).float(), head.float()), hk


class Alternating:
    """A cost under which drafting pays on odd rounds only (counted by the planner's calls: a
    decision fixed before any draw)."""

    def __init__(self):
        self.n, self.dear = 0, False

    def __call__(self, R, rows):
        return 0.01

    def theta(self, R, tau):
        self.n += 1
        self.dear = self.n % 2 == 0
        return tau / (0.01 + self.draft(R))

    def draft(self, R):
        return 1.0 if self.dear else 0.0

    def plain(self, R):
        return 0.01
