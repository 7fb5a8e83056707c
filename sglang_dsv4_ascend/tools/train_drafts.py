"""Training forwards and losses for the draft heads of the trained tiny model (tools/train_tiny.py),
after DeepSpec's recipe (reference §2.7), scaled down.

The serving forwards (`NextN.step`, `DSparkDraft.block`) read caches; these are the same modules
run over whole teacher-forced sequences with the key sets spelled out, so autograd sees every
weight. tests/unit/test_train_tiny.py checks each against its serving forward on the same weights.

Data: sequences x[0..S] with the frozen target's outputs over x[0..S-1]: its distribution P[p] of
token p+1, its pre-head streams X[p] (NextN's input) and the streams of the DSpark target layers
(its features).

NextN, row i (0 <= i <= S-2): reads x[i+1] and X[i], predicts token i+2; label P[i+1]. Its
attention is causal SWA over its own rows, as its cache holds them when serving.
DSpark, anchor L (1 <= L <= S-gamma): context = the injected features of L-W .. L-1, block
[x[L], noise...] at L .. L+gamma-1; block row k-1 predicts token L+k with label P[L+k-1]; the
Markov head reads x[L+k-1] (teacher forcing: on the target's own generations these are the
target's choices, which is what an accepted prefix holds); the confidence head learns whether
the draft's argmax equals the target's.
Loss per predicted position: CE to the target's argmax + total variation to P (the acceptance
probability of a sampled draft is 1 - TV), weighted decay^(k-1) along the block; BCE for the
confidence.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .. import ops
from ..batch import Segment
from ..layers.mhc import hc_head


# -- the frozen target ----------------------------------------------------------------------------
@torch.no_grad()
def target_outputs(model, x: torch.Tensor, layer_ids=()) -> dict:
    """Run the serving model over x [B, S] (a fresh cache per call). -> {"logits" [B, S, V] fp32,
    "streams" [B, S, hc, d], "layer_streams" {id: [B, S, hc, d]}}."""
    B, S = x.shape
    cache = model.make_cache(B, S)
    segs = [Segment(b, 0, S) for b in range(B)]
    aux = {"layer_ids": tuple(layer_ids)}
    pos = torch.arange(S).repeat(B)
    h = model(x.flatten(), pos, segs, cache, aux=aux)
    return {
        "logits": model.compute_logits(h).view(B, S, -1),
        "streams": aux["streams"].view(B, S, *aux["streams"].shape[1:]),
        "layer_streams": {i: s.view(B, S, *s.shape[1:]) for i, s in aux["layer_streams"].items()},
    }


@torch.no_grad()
def generate(model, prompts: list[list[int]], n_new: int, temperature: float, seed: int, eos: int | None = None):
    """The target's own continuations (batched decode through the serving forward). Sampling at
    `temperature` (0 = greedy) with a seeded generator. -> list of full sequences (prompt + new)."""
    g = torch.Generator().manual_seed(seed)
    B = len(prompts)
    cache = model.make_cache(B, max(map(len, prompts)) + n_new)
    segs = [Segment(b, 0, len(p)) for b, p in enumerate(prompts)]
    ids = torch.tensor([t for p in prompts for t in p])
    pos = torch.cat([torch.arange(len(p)) for p in prompts])
    h = model(ids, pos, segs, cache)
    last = torch.cumsum(torch.tensor([len(p) for p in prompts]), 0) - 1
    out = [list(p) for p in prompts]
    logits = model.compute_logits(h[last])
    for step in range(n_new):
        if temperature > 0:
            nxt = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=g).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        for b in range(B):
            out[b].append(int(nxt[b]))
        if step == n_new - 1:
            break
        segs = [Segment(b, len(out[b]) - 1, 1) for b in range(B)]
        h = model(nxt, torch.tensor([len(o) - 1 for o in out]), segs, cache)
        logits = model.compute_logits(h)
    return out


# -- losses ---------------------------------------------------------------------------------------
def distill_loss(logits: torch.Tensor, p_target: torch.Tensor) -> torch.Tensor:
    """Per row: CE to the target's argmax + total variation to its distribution. [N]"""
    ce = F.cross_entropy(logits.float(), p_target.argmax(-1), reduction="none")
    tv = 0.5 * (torch.softmax(logits.float(), -1) - p_target).abs().sum(-1)
    return ce + tv


# -- NextN ------------------------------------------------------------------------------------------
def swa_attention(attn, x, positions, B: int, S: int):
    """Causal sliding-window attention with sink over B sequences of S rows each (rows b*S + t),
    the key set the serving cache gives a row at position t: positions t-W+1 .. t."""
    cos, sin, _, q, kv = attn._project(x, positions)
    W = attn.window
    t = torch.arange(S)
    idx = t[:, None] - (W - 1) + torch.arange(W)
    ok = (idx >= 0).repeat(B, 1)
    rows = (torch.arange(B)[:, None, None] * S + idx.clamp(min=0)).flatten(0, 1)
    out = ops.sparse_attention_with_sink(q, kv, rows, ok, attn.attn_sink, attn.head_dim**-0.5)
    return attn._finish(out, cos, sin)


def nextn_logits(nextn, embed, head_w, next_ids: torch.Tensor, states: torch.Tensor) -> torch.Tensor:
    """next_ids [B, S] (x[i+1]), states [B, S, hc, d] (X[i]) -> logits [B, S, V] of token i+2."""
    B, S = next_ids.shape
    ids = next_ids.flatten()
    pos = torch.arange(S).repeat(B)
    e = nextn.e_proj(nextn.enorm(embed(ids)))
    x = e.unsqueeze(1) + nextn.h_proj(nextn.hnorm(states.flatten(0, 1).to(e.dtype)))
    out = nextn.mix(x, ids, lambda y: swa_attention(nextn.attn, y, pos, B, S))
    h = hc_head(out, nextn.hc_head_fn, nextn.hc_head_base, nextn.hc_head_scale, nextn.cfg)
    return F.linear(nextn.norm(h).float(), head_w.float()).view(B, S, -1)


def nextn_loss(nextn, embed, head_w, x: torch.Tensor, tgt: dict) -> tuple[torch.Tensor, dict]:
    """x [B, S+1]; tgt from target_outputs(x[:, :S])."""
    S = x.shape[1] - 1
    logits = nextn_logits(nextn, embed, head_w, x[:, 1:S], tgt["streams"][:, : S - 1])
    p = torch.softmax(tgt["logits"][:, 1:S], -1)
    loss = distill_loss(logits.flatten(0, 1), p.flatten(0, 1)).mean()
    acc = (logits.argmax(-1) == p.argmax(-1)).float().mean()
    return loss, {"loss": float(loss.detach()), "acc1": float(acc)}


# -- DSpark -----------------------------------------------------------------------------------------
def anchors(S: int, gamma: int, per_seq: int, B: int, g: torch.Generator) -> torch.Tensor:
    """[B, per_seq] anchor positions L in [1, S - gamma]."""
    return torch.randint(1, S - gamma + 1, (B, per_seq), generator=g)


def dspark_block(draft, embed, head_w, feats: torch.Tensor, x: torch.Tensor, L: torch.Tensor, gamma: int):
    """Base logits U [n, gamma, V] and features h [n, gamma, d] for anchors L [B, A] of sequences
    x [B, >= S] whose target features are feats [B, S, d] (the features at every position; the
    context of an anchor is L-W .. L-1 of its own sequence)."""
    cfg = draft.cfg
    B, S, _ = feats.shape
    A = L.shape[1]
    n, W = B * A, cfg.sliding_window
    Lf = L.flatten()
    seq = torch.arange(B).repeat_interleave(A)
    ids = torch.full((n, gamma), cfg.dspark_noise_token_id, dtype=torch.long)
    ids[:, 0] = x[seq, Lf]
    ids = ids.flatten()
    positions = (Lf[:, None] + torch.arange(gamma)).flatten()
    ctx_pos = Lf[:, None] - W + torch.arange(W)
    ctx_rows = seq[:, None] * S + ctx_pos.clamp(min=0)
    blk_rows = B * S + torch.arange(n * gamma).view(n, gamma)
    ctx = SimpleNamespace(
        key_rows=torch.cat([ctx_rows, blk_rows], 1).repeat_interleave(gamma, 0),
        key_ok=torch.cat([ctx_pos >= 0, torch.ones(n, gamma, dtype=torch.bool)], 1).repeat_interleave(gamma, 0),
    )
    flat_feat, flat_pos = feats.flatten(0, 1), torch.arange(S).repeat(B)
    h = embed(ids).unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
    for stage in draft.mtp:
        ring = stage.inject(flat_feat, flat_pos).unsqueeze(0)
        h = stage(h, ids, positions, ctx.key_rows, ctx.key_ok, ring)
    last = draft.mtp[-1]
    hh = hc_head(h, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, cfg)
    logits = F.linear(last.norm(hh).float(), head_w.float())
    return logits.view(n, gamma, -1), hh.view(n, gamma, -1)


def dspark_features(draft, tgt: dict) -> torch.Tensor:
    ls = tgt["layer_streams"]
    B, S = next(iter(ls.values())).shape[:2]
    flat = {i: s.flatten(0, 1) for i, s in ls.items()}
    return draft.features(flat).view(B, S, -1)


def dspark_loss(
    draft, embed, head_w, x: torch.Tensor, tgt: dict, gamma: int, per_seq: int, g, decay=0.8, conf_weight=0.5
):
    B, S = x.shape[0], x.shape[1] - 1
    L = anchors(S, gamma, per_seq, B, g)
    feats = dspark_features(draft, tgt)
    U, h = dspark_block(draft, embed, head_w, feats, x, L, gamma)
    n = U.shape[0]
    seq = torch.arange(B).repeat_interleave(per_seq)
    rows = L.flatten()[:, None] + torch.arange(gamma)  # P index of block row k-1: L+k-1
    p = torch.softmax(tgt["logits"][seq[:, None], rows], -1)  # [n, gamma, V]
    prev = x[seq[:, None], rows]  # x[L+k-1]
    last = draft.mtp[-1]
    z = U + last.markov_head.bias(prev.flatten()).view(n, gamma, -1)
    w = decay ** torch.arange(gamma, dtype=torch.float32)
    per = distill_loss(z.flatten(0, 1), p.flatten(0, 1)).view(n, gamma)
    hit = (z.argmax(-1) == p.argmax(-1)).float()
    e = last.confidence_head(torch.cat([h.detach().float(), last.markov_head.markov_w1(prev).detach().float()], -1))
    bce = F.binary_cross_entropy_with_logits(e, hit)
    loss = (per * w).sum(-1).mean() / w.sum() + conf_weight * bce
    return loss, {
        "loss": float(loss.detach()),
        "bce": float(bce.detach()),
        "acc1": float(hit[:, 0].mean()),
        "acc_all": float(hit.mean()),
    }


# -- confidence calibration (STS) -------------------------------------------------------------------
@torch.no_grad()
def dspark_greedy_rollout(draft, embed, head_w, x: torch.Tensor, tgt: dict, L: torch.Tensor, gamma: int):
    """The served greedy chain from each anchor: x_k = argmax(U_k + Markov(x_{k-1})) with x_0 the
    anchor; its confidence logits e_k; accepted_k = every draft up to k equals the sequence's next
    tokens (on the target's own greedy generations this is exactly what verify accepts).
    -> (e [n, gamma], accepted prefix mask [n, gamma])."""
    B, A = L.shape
    feats = dspark_features(draft, tgt)
    U, h = dspark_block(draft, embed, head_w, feats, x, L, gamma)
    last = draft.mtp[-1]
    seq = torch.arange(B).repeat_interleave(A)
    prev = x[seq, L.flatten()]
    es, ok = [], []
    run = torch.ones(prev.shape[0], dtype=torch.bool)
    for k in range(gamma):
        z = U[:, k] + last.markov_head.bias(prev)
        tok = z.argmax(-1)
        es.append(last.confidence_head(torch.cat([h[:, k].float(), last.markov_head.markov_w1(prev).float()], -1)))
        run = run & (tok == x[seq, L.flatten() + k + 1])
        ok.append(run.clone())
        prev = tok
    return torch.stack(es, 1), torch.stack(ok, 1)


def sequential_temperatures(e: torch.Tensor, accepted: torch.Tensor, grid=None) -> tuple[list[float], list[dict]]:
    """Sequential temperature scaling: T_k minimises the BCE of sigmoid(e_k / T_k) against
    "draft k accepted", over the anchors whose drafts 1..k-1 were all accepted (the only ones
    whose c_k matters to the survival a_k = prod c_i). A grid search (log-spaced) keeps it exact
    and dependency-free. -> temperatures, per-position report."""
    grid = (
        grid if grid is not None else [math.exp(v) for v in torch.linspace(math.log(0.2), math.log(8.0), 81).tolist()]
    )
    temps, report = [], []
    for k in range(e.shape[1]):
        live = accepted[:, k - 1] if k else torch.ones(e.shape[0], dtype=torch.bool)
        ek, yk = e[live, k].float(), accepted[live, k].float()
        if yk.numel() < 20:
            temps.append(temps[-1] if temps else 1.0)
            report.append({"position": k + 1, "samples": int(yk.numel()), "temperature": temps[-1], "note": "too few"})
            continue
        nll = [float(F.binary_cross_entropy_with_logits(ek / t, yk)) for t in grid]
        best = min(range(len(grid)), key=nll.__getitem__)
        temps.append(grid[best])
        report.append(
            {
                "position": k + 1,
                "samples": int(yk.numel()),
                "accept_rate": float(yk.mean()),
                "temperature": grid[best],
                "bce_before": float(F.binary_cross_entropy_with_logits(ek, yk)),
                "bce_after": nll[best],
                "mean_confidence_after": float(torch.sigmoid(ek / grid[best]).mean()),
            }
        )
    return temps, report
