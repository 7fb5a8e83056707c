"""The DeepSeek-V4 NextN (MTP) draft block, `mtp.0.*` of a preview checkpoint (reference §1.7).

At draft position i it reads the embedding of token i+1 and a state X_i of n = hc_mult streams
(the target's pre-head streams at i, or, when chained, this block's own output streams at i-1):
    e   = e_proj(enorm(embed(token_{i+1})))                 broadcast to the n streams
    X0  = e + h_proj(hnorm(X_i))                             (hnorm and h_proj per stream)
    X1  = Block(X0)                                          one V4 block: SWA-only attention with
                                                             sink (theta 10000), non-hash MoE,
                                                             its own SWA cache
    out = head(norm(hc_head(X1)))                            shared embedding and head
and predicts token i+2. X1 is what the next chained step reads as its X.

The block's parameters keep the released names under `mtp.0.` (`mtp.0.attn.wq_a.weight`,
`mtp.0.hc_attn_fn`, `mtp.0.e_proj.weight`, ...), so NextN is the Block itself plus the extras.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ..config import DSV4Config
from ..kvcache import plan as kv_plan
from ..kvcache.cache import DSV4Cache
from ..layers import RMSNorm
from ..layers.mhc import hc_head
from .trunk import Block, add_hc_head, cast_params, layer_segments
from .weights import iter_checkpoint, load_released_weights

PREFIX = "mtp.0."


def draft_config(cfg: DSV4Config) -> DSV4Config:
    """The config a one-layer draft sees: its layer 0 is SWA-only and never hash-routed."""
    return dataclasses.replace(
        cfg, num_hidden_layers=1, compress_ratios=(0,), hash_layers=(False,), draft_compress_ratios=()
    )


def has_nextn(names) -> bool:
    return f"{PREFIX}e_proj.weight" in names


class NextN(Block):
    def __init__(self, cfg: DSV4Config, dtype=torch.float32, device=None):
        dcfg = draft_config(cfg)
        super().__init__(dcfg, 0, dtype, device)
        d = cfg.hidden_size
        kw = dict(bias=False, dtype=dtype, device=device)
        self.e_proj = nn.Linear(d, d, **kw)
        self.h_proj = nn.Linear(d, d, **kw)
        self.enorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.hnorm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, device=device)
        add_hc_head(self, cfg, device)
        cast_params(self, dtype)
        self.dtype = dtype

    def make_cache(self, num_slots: int, max_context_len: int, spec_slack: int, device=None):
        return DSV4Cache(self.cfg, num_slots, max_context_len, spec_slack, dtype=self.dtype, device=device)

    @torch.no_grad()
    def step(self, input_ids, states, positions, segments, cache, embed: nn.Embedding, pending=None, plan=None):
        """One draft forward over `segments` (rows as in DSV4Model.forward). `input_ids` [T]: token
        i+1 of each row; `states` [T, hc, d]: X_i. Returns (hidden [T, d] for the shared head,
        output streams [T, hc, d] for the next chained step)."""
        segments = layer_segments(input_ids, positions, segments, cache, pending, plan)
        if plan is None and segments:
            plan = kv_plan.build_plan(segments, cache, device=input_ids.device)
        e = self.e_proj(self.enorm(embed(input_ids)))
        x = e.unsqueeze(1) + self.h_proj(self.hnorm(states.to(e.dtype)))
        out = self(x, input_ids, positions, segments, cache, pending, plan)
        h = hc_head(out, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg)
        return self.norm(h), out


def load_nextn_from_dir(path: str, cfg: DSV4Config, dtype=torch.float32, device=None) -> NextN:
    """The `mtp.0.*` NextN block of a checkpoint dir (tools, tests, in-process benchmarks)."""
    block = NextN(cfg, dtype=dtype, device=device)
    load_released_weights(
        block, iter_checkpoint(path, skip=lambda n: not n.startswith(PREFIX)), source=path, prefix=PREFIX
    )
    return block.eval()
