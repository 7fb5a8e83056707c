"""mHC: manifold-constrained hyper-connections (reference §1.5).

The residual stream is X in R^{n x d} per token (n = hc_mult). Around every sublayer F:
    pre, post, comb = weights(X)                       (fp32, Sinkhorn for comb)
    y  = sum_i pre_i X_i                               -> norm -> F
    X'_i = post_i F(y) + sum_j comb[j, i] X_j          (comb indexed [source j, destination i])
The parameters keep their released names (`hc_attn_fn/base/scale`, `hc_ffn_*`, `hc_head_*`) on the
owning module, so these are functions over (streams, fn, base, scale).
"""

from __future__ import annotations

import torch

from .. import ops
from ..ops.reference import pad_rows


def hc_pre(streams: torch.Tensor, fn, base, scale, cfg):
    """Collapse the n streams into the sublayer input. Returns (y [T, d], post [T, n], comb [T, n, n])."""
    pre, post, comb = ops.mhc_weights(
        streams, fn, base, scale, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
    )
    y = (pre.unsqueeze(-1) * streams.float()).sum(dim=-2)
    return y.to(streams.dtype), post, comb


def hc_post(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """X'_i = post_i * out + sum_j comb[j, i] X_j, mixed in fp32."""
    mixed = torch.einsum("tji,tjd->tid", comb, streams.float())
    return (post.unsqueeze(-1) * out.float().unsqueeze(-2) + mixed).to(streams.dtype)


def hc_head(streams: torch.Tensor, fn, base, scale, cfg) -> torch.Tensor:
    """Final collapse before the output norm: h = sum_i (sigmoid(mix_i*scale + base_i) + eps) X_i."""
    # on padded rows, as mhc_weights (ops.reference.pad_rows: a decode row rounds as a verify row)
    mix = ops.mhc_mix(pad_rows(streams), fn, cfg.rms_norm_eps)
    pre = (torch.sigmoid(mix * scale.float() + base.float()) + cfg.hc_eps)[: streams.shape[0]]
    return (pre.unsqueeze(-1) * streams.float()).sum(dim=-2).to(streams.dtype)
