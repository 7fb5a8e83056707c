"""The DeepSeek-V4 DSpark draft (reference §1.8, §2.2-2.3): three V4 blocks `mtp.0..2` fed by
target features, a Markov head and a confidence head.

Target features. For a committed position p, with S_l(p) the output streams of target layer l:
    f_p = main_norm(main_proj(concat_{l in dspark_target_layer_ids} mean_streams S_l(p)))     [d]
Context injection: every stage s keeps its own SWA ring; position p's key/value there is
    kv_s(p) = RoPE_p(kv_norm_s(wkv_s f_p))         (no mHC, no attn_norm on this path)
so the draft never runs its blocks over context tokens.

Block. For a request with committed length L and anchor a (the last target sample, position L):
    inputs x = [a, m, ..., m] (gamma tokens, m = dspark_noise_token_id), positions L .. L+gamma-1,
    X0 = embed(x) broadcast to the hc streams,  X_{s+1} = Stage_s(X_s) for s = 0, 1, 2,
where a stage is a V4 block whose attention query at any block row sees the context positions
L-W .. L-1 of its ring (W = sliding_window) and all gamma block rows (bidirectional inside the
block), with the attention sink. Then
    h_k = hc_head_2(X_3)[k-1]          (the confidence head's feature, before the final norm)
    U_k = head(norm_2(h_k))            base logits of draft token k, k = 1..gamma
Markov head (rank r, W1 = markov_w1 [V, r], W2 = markov_w2 [V, r]), left to right from x_0 = a:
    z_k = U_k + W2 W1[x_{k-1}],   x_k = argmax z_k (greedy) or x_k ~ q_k = softmax(z_k / T)
Confidence head: e_k = proj([h_k ; W1[x_{k-1}]]) in fp32, c_k = sigmoid(e_k / T_k) with the STS
per-position temperatures T_k (1 without a calibration file). Survival a_k = prod_{i<=k} c_i.

gamma is a runtime choice (`--speculative-dspark-block-size`), independent of the checkpoint's
native `dspark_block_size`: nothing here is sized by the latter.
"""

from __future__ import annotations

import json
from typing import Callable

import torch
from torch import nn

from .. import ops
from ..config import DSV4Config
from ..layers import RMSNorm
from ..layers.mhc import hc_head
from .nextn import draft_config
from .trunk import Block, add_hc_head, cast_params
from .weights import iter_checkpoint, load_released_weights

N_STAGES = 3


def has_dspark(names) -> bool:
    return "mtp.0.main_proj.weight" in names


class MarkovHead(nn.Module):
    def __init__(self, vocab: int, rank: int, dtype=None, device=None):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab, rank, dtype=dtype, device=device)
        self.markov_w2 = nn.Linear(rank, vocab, bias=False, dtype=dtype, device=device)

    def bias(self, prev_tokens: torch.Tensor) -> torch.Tensor:
        """[n, V] fp32: <W1[prev], W2[v]> for every v."""
        return self.markov_w2(self.markov_w1(prev_tokens)).float()


class ConfidenceHead(nn.Module):
    def __init__(self, width: int, bias: bool, device=None):
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=bias, dtype=torch.float32, device=device)

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return self.proj(feat.float()).squeeze(-1)


class Stage(Block):
    """One DSpark stage: a V4 block (SWA-only attention with sink, non-hash MoE) whose attention
    runs over [its injected context ring; the block], bidirectionally inside the block."""

    def forward(self, streams, input_ids, positions, key_rows, key_ok, ring):
        """`ring` [num_slots + 1, R, head_dim]: this stage's injected context K/V (any [.., .., D]
        whose flattened rows `key_rows` address, followed by the block's own rows)."""
        return self.mix(streams, input_ids, lambda x: self._attention(x, positions, key_rows, key_ok, ring))

    def _attention(self, x, positions, key_rows, key_ok, ring):
        a = self.attn
        cos, sin, _, q, kv = a._project(x, positions)
        pool = torch.cat([ring.flatten(0, 1), kv.to(ring.dtype)])
        out = ops.sparse_attention_with_sink(q, pool, key_rows, key_ok, a.attn_sink, a.head_dim**-0.5)
        return a._finish(out, cos, sin)

    def inject(self, feat: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Context K/V of target features `feat` [n, d] at `positions` [n]."""
        cos, sin = self.attn.rotary(positions)
        return ops.apply_rope(self.attn.kv_norm(self.attn.wkv(feat)), cos, sin)


class BlockContext:
    """Key geometry of one block forward, shared by the three stages: for block row (request i,
    offset k) the keys are ring rows slot_i * R + (L_i - W + j) % R for j < W (valid when the
    position is >= 0) and the block rows i * gamma + 0 .. gamma - 1 (always valid)."""

    def __init__(self, cache: "DSparkCache", slots, starts, gamma: int, device):
        W, R, n = cache.window, cache.ring, len(slots)
        slot = torch.as_tensor(slots, dtype=torch.long).view(n, 1)
        L = torch.as_tensor(starts, dtype=torch.long).view(n, 1)
        ctx_pos = L - W + torch.arange(W)
        ctx_rows = slot * R + ctx_pos.clamp(min=0) % R  # [n, W]
        blk_rows = cache.rings.shape[1] * R + torch.arange(n * gamma).view(n, gamma)  # after the rings
        rows = torch.cat([ctx_rows, blk_rows], dim=1).repeat_interleave(gamma, dim=0)
        ok = torch.cat([ctx_pos >= 0, torch.ones(n, gamma, dtype=torch.bool)], dim=1).repeat_interleave(gamma, dim=0)
        self.key_rows, self.key_ok = rows.to(device), ok.to(device)


class DSparkCache:
    """Per stage, an SWA ring of injected context K/V: rings [3, num_slots + 1, R, head_dim] with
    R = sliding_window + slack; row of position p is p % R. Only committed positions are written
    (the block's own rows are recomputed every round), so validity is the committed length, as
    for the target's cache; the slack keeps a re-draft from the same L (tests) exact."""

    def __init__(self, cfg: DSV4Config, num_slots: int, slack: int, dtype=torch.float32, device=None):
        self.window, self.ring = cfg.sliding_window, cfg.sliding_window + slack
        self.rings = torch.zeros(N_STAGES, num_slots + 1, self.ring, cfg.head_dim, dtype=dtype, device=device)


CHECKPOINT_STS_FILE = "dspark_sts.json"  # a calibration shipped inside the checkpoint dir


def sts_path(flag_value: str | None, model_path: str | None) -> str | None:
    """--speculative-dspark-confidence-sts-path if given, else the checkpoint's own calibration
    (`dspark_sts.json` beside config.json, as our trained tiny model ships it), else None."""
    if flag_value:
        return flag_value
    import os

    own = os.path.join(model_path, CHECKPOINT_STS_FILE) if model_path else None
    return own if own and os.path.isfile(own) else None


def load_sts(path: str | None) -> list[float] | None:
    """Per-position confidence temperatures from a calibration JSON: {"temperatures": [T_1, ...]}
    (a bare list is accepted too). Positions beyond the list use its last value."""
    if not path:
        return None
    flag = "--speculative-dspark-confidence-sts-path"
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag} {path}: cannot read a JSON calibration file ({e})") from e
    temps = data.get("temperatures") if isinstance(data, dict) else data
    if not isinstance(temps, list) or not temps or not all(isinstance(t, (int, float)) and t > 0 for t in temps):
        raise ValueError(f'{flag} {path}: expected {{"temperatures": [T_1, T_2, ...]}}}} with positive numbers')
    return [float(t) for t in temps]


class DSparkDraft(nn.Module):
    """`mtp.0..2` of a DSpark checkpoint, parameters under their released names."""

    def __init__(self, cfg: DSV4Config, dtype=torch.float32, device=None, confidence_bias: bool = True):
        super().__init__()
        if not cfg.dspark_target_layer_ids or cfg.dspark_markov_rank is None or cfg.dspark_noise_token_id is None:
            raise ValueError(
                "DSpark draft: the checkpoint config needs dspark_target_layer_ids, dspark_markov_rank "
                "and dspark_noise_token_id"
            )
        self.cfg, self.dtype = cfg, dtype
        dcfg = draft_config(cfg)
        if cfg.dspark_n_routed_experts or cfg.dspark_num_experts_per_tok:
            import dataclasses

            dcfg = dataclasses.replace(
                dcfg,
                n_routed_experts=cfg.dspark_n_routed_experts or cfg.n_routed_experts,
                num_experts_per_tok=cfg.dspark_num_experts_per_tok or cfg.num_experts_per_tok,
            )
        d, V, r = cfg.hidden_size, cfg.vocab_size, cfg.dspark_markov_rank
        self.mtp = nn.ModuleList(Stage(dcfg, 0, dtype, device) for _ in range(N_STAGES))
        first, last = self.mtp[0], self.mtp[-1]
        n_feat = len(cfg.dspark_target_layer_ids)
        first.main_proj = nn.Linear(n_feat * d, d, bias=False, dtype=dtype, device=device)
        first.main_norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, device=device)
        last.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, device=device)
        add_hc_head(last, cfg, device)
        last.markov_head = MarkovHead(V, r, dtype, device)
        last.confidence_head = ConfidenceHead(d + r, confidence_bias, device)
        cast_params(self, dtype)
        last.confidence_head.float()  # computed in fp32 (reference §2.3)
        self.sts = None  # per-position confidence temperatures (load_sts)

    def make_cache(self, num_slots: int, slack: int, device=None) -> DSparkCache:
        return DSparkCache(self.cfg, num_slots, slack, dtype=self.dtype, device=device)

    # -- context ---------------------------------------------------------------------------------
    def features(self, layer_streams: list, rows: torch.Tensor | None = None) -> torch.Tensor:
        """f for the target rows `rows` (all rows if None) of a forward's `aux["layer_streams"]`."""
        parts = []
        for lid in self.cfg.dspark_target_layer_ids:
            s = layer_streams[lid] if rows is None else layer_streams[lid][rows]
            parts.append(s.float().mean(dim=1).to(self.dtype))
        first = self.mtp[0]
        return first.main_norm(first.main_proj(torch.cat(parts, dim=-1)))

    @torch.no_grad()
    def inject(
        self, cache: DSparkCache, feat: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, before_store=None
    ) -> None:
        """Store every stage's context K/V for target features `feat` [n, d] of (slot, position).
        `before_store(stage, kv, ring)`: called with each stage's new rows before they overwrite
        its ring (the prefix states copy boundary windows there)."""
        if feat.shape[0] == 0:
            return
        # Only the last R positions of each slot land in its ring: two rows of one index_put must
        # never collide (which one lands is unspecified); older ones go to the scratch slot (the
        # last), which nothing reads. Fixed shapes, no host read.
        last = torch.full((cache.rings.shape[1],), -1, dtype=positions.dtype, device=positions.device)
        last = last.scatter_reduce(0, slots, positions, reduce="amax")
        scratch = cache.rings.shape[1] - 1
        rows = torch.where(positions > last[slots] - cache.ring, slots, scratch) * cache.ring + positions % cache.ring
        for s, stage in enumerate(self.mtp):
            kv = stage.inject(feat, positions)
            if before_store is not None:
                before_store(s, kv, cache.rings[s])
            cache.rings[s].view(-1, cache.rings.shape[-1])[rows] = kv.to(cache.rings.dtype)

    # -- the block --------------------------------------------------------------------------------
    @torch.no_grad()
    def block(
        self,
        cache: DSparkCache,
        slots,
        starts,
        anchors: torch.Tensor,
        gamma: int,
        embed: nn.Embedding,
        head: Callable[[torch.Tensor], torch.Tensor],
    ):
        """Base logits U [n, gamma, V] (fp32) and confidence features h [n, gamma, d] of each
        request's block [anchor, noise x (gamma - 1)] at positions L .. L + gamma - 1. `embed`
        and `head` (hidden -> fp32 logits over the whole vocabulary: the target's compute_logits,
        which gathers a vocab-parallel head) are the target's, shared."""
        n = len(slots)
        logits, h = self.block_forward(
            *self.block_inputs(cache, slots, starts, anchors, gamma), cache.rings, embed, head
        )
        return logits.view(n, gamma, -1), h.view(n, gamma, -1)

    def block_inputs(self, cache: DSparkCache, slots, starts, anchors: torch.Tensor, gamma: int):
        """(ids, positions, key_rows, key_ok) of the blocks, flat over n * gamma rows: what a block
        forward reads besides the rings (host work; a captured block reads them from buffers)."""
        if gamma < 1:
            raise ValueError(f"DSpark block size must be >= 1, got {gamma}")
        n, dev = len(slots), anchors.device
        ids = torch.full((n, gamma), self.cfg.dspark_noise_token_id, dtype=torch.long, device=dev)
        ids[:, 0] = anchors
        positions = (torch.as_tensor(starts, dtype=torch.long).view(n, 1) + torch.arange(gamma)).flatten().to(dev)
        ctx = BlockContext(cache, slots, starts, gamma, dev)
        return ids.flatten(), positions, ctx.key_rows, ctx.key_ok

    def block_forward(self, ids, positions, key_rows, key_ok, rings, embed, head):
        """The three stages over the blocks' rows: (U [n * gamma, V], h [n * gamma, d])."""
        x = embed(ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for stage, ring in zip(self.mtp, rings):
            x = stage(x, ids, positions, key_rows, key_ok, ring)
        last = self.mtp[-1]
        h = hc_head(x, last.hc_head_fn, last.hc_head_base, last.hc_head_scale, self.cfg)
        return head(last.norm(h)), h

    def markov_chain(self, U, h, anchors, temps, generator):
        """The drafts, left to right from x_0 = a: z_k = U_k + W2 W1[x_{k-1}], x_k = argmax z_k for
        a greedy row (temps[i] None), x_k ~ q_k = softmax(z_k / temps[i]) drawn with `generator`
        (CPU) otherwise; c_k from (h_k, x_{k-1}). U, h: [n, gamma, .] from the block. Returns
        (x [n, gamma], per row its q's [gamma, V] or None when greedy, c [n, gamma])."""
        n, gamma = U.shape[:2]
        sampled = [i for i, t in enumerate(temps) if t is not None]
        T = torch.tensor([temps[i] for i in sampled], dtype=torch.float32).view(-1, 1)
        prev, xs, cs, qs = anchors, [], [], [[] for _ in range(n)]
        markov = self.mtp[-1].markov_head
        for k in range(1, gamma + 1):
            z = U[:, k - 1] + markov.bias(prev)
            cs.append(self.confidence(h[:, k - 1], prev, k))
            x = z.argmax(dim=-1)
            if sampled:
                q = torch.softmax(z[sampled].to("cpu") / T, dim=-1)
                x[sampled] = torch.multinomial(q, 1, generator=generator).view(-1).to(x)
                for j, i in enumerate(sampled):
                    qs[i].append(q[j])
            xs.append(x)
            prev = x
        return torch.stack(xs, dim=1), [torch.stack(q) if q else None for q in qs], torch.stack(cs, dim=1)

    def markov_greedy(self, U, h, anchors):
        """markov_chain of greedy rows only: (x [n, gamma], c [n, gamma]). Tensor ops alone (no draw,
        no branch on values), so a captured draft block runs it after its stages
        (speculative/graphs.DraftGraphs) instead of 2 x gamma small eager steps."""
        x, _, c = self.markov_chain(U, h, anchors, [None] * U.shape[0], None)
        return x, c

    def confidence(self, h_k: torch.Tensor, prev_tokens: torch.Tensor, k: int) -> torch.Tensor:
        """c_k [n] for block position k (1-based) from h_k [n, d] and x_{k-1} [n]."""
        last = self.mtp[-1]
        e = last.confidence_head(torch.cat([h_k.float(), last.markov_head.markov_w1(prev_tokens).float()], dim=-1))
        t = 1.0 if not self.sts else self.sts[min(k, len(self.sts)) - 1]
        return torch.sigmoid(e / t)


PREFIX = "mtp."
CONFIDENCE_BIAS = "mtp.2.confidence_head.proj.bias"  # absent in the released V4 heads


def load_dspark(draft: DSparkDraft, weights, source=None) -> None:
    """Load `mtp.*` (name, tensor[, file]) items into `draft` by their released names."""
    load_released_weights(draft.mtp, weights, source=source, prefix=PREFIX)


def load_dspark_from_dir(path: str, cfg: DSV4Config, dtype=torch.float32, device=None) -> DSparkDraft:
    """The `mtp.0..2` DSpark draft of a checkpoint dir (tools, tests, in-process benchmarks)."""
    items = list(iter_checkpoint(path, skip=lambda n: not n.startswith(PREFIX)))
    draft = DSparkDraft(cfg, dtype=dtype, device=device, confidence_bias=any(it[0] == CONFIDENCE_BIAS for it in items))
    load_dspark(draft, items, source=path)
    return draft.eval()
