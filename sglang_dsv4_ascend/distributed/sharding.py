"""How each released DeepSeek-V4 tensor is split over the ranks of a `Layout` (see layout.py for
what is replicated and why). The names are the released ones, so the rules read as the layout:

    layers.N.attn.wq_b.weight        [H*D, q_lora]     rows: this rank's heads
    layers.N.attn.attn_sink          [H]               this rank's heads
    layers.N.attn.wo_a.weight        [G*o_lora, H*D/G] rows: this rank's groups (whole groups)
    layers.N.attn.wo_b.weight        [d, G*o_lora]     columns: this rank's groups (row-parallel)
      (tp > G: tp/G ranks share a group: its wo_a rows with their heads' columns, its wo_b columns)
    layers.N.ffn.experts.E.w1/w3     [inter, d]        only E on this EP rank; rows: its MoE-TP part
    layers.N.ffn.experts.E.w2        [d, inter]        only E on this EP rank; columns: the same part
    layers.N.ffn.shared_experts.*    w1/w3 rows, w2 columns: this TP rank's part
    embed.weight, head.weight        [vocab, d]        rows: this attention-TP rank's vocabulary
                                                       (when the group divides it; else whole)
"""

from __future__ import annotations

import re

import torch

from .layout import Layout

_ATTN = re.compile(r"^layers\.\d+\.attn\.(wq_b\.weight|attn_sink|wo_a\.weight|wo_b\.weight)$")
_EXPERT = re.compile(r"^layers\.\d+\.ffn\.experts\.(\d+)\.(w[123])\.weight$")
_SHARED = re.compile(r"^layers\.\d+\.ffn\.shared_experts\.(w[123])\.weight$")
_VOCAB = ("embed.weight", "head.weight")

SKIP = object()  # a tensor another rank holds


def _shape(t) -> tuple:
    return tuple(t.shape if isinstance(t, torch.Tensor) else t.get_shape())


def _part(t, dim: int, rank: int, size: int) -> torch.Tensor:
    """Part `rank` of `size` along `dim` of a tensor (a view) or of a safetensors slice (read from
    the file: only that part)."""
    n = _shape(t)[dim]
    if n % size:
        raise ValueError(f"dimension {dim} of size {n} cannot be split over {size} ranks")
    step = n // size
    return t[(slice(None),) * dim + (slice(rank * step, (rank + 1) * step),)]


def rank_part(layout: Layout, n_experts: int, n_groups: int):
    """For `models.weights.iter_checkpoint(part=...)`: (name, safetensors slice) -> this rank's part
    read from the file (a split tensor by slice, a replicated one whole), or SKIP for another
    rank's expert, which is then never read. The loader is told the parts are already cut
    (`presliced`)."""

    def take(name, sl):
        part = shard(name, sl, layout, n_experts, n_groups)
        return part if part is SKIP or isinstance(part, torch.Tensor) else part[:]

    return take


def shard(name: str, t: torch.Tensor, layout: Layout, n_experts: int, n_groups: int):
    """This rank's part of released tensor `name` (a view), SKIP if another rank holds it, or
    the tensor itself when it is replicated."""
    if not layout.sharded:
        return t
    m = _ATTN.match(name)
    if m:
        what, r, tp = m.group(1), layout.attn_tp_rank, layout.attn_tp_size
        if what in ("wq_b.weight", "attn_sink") or tp <= n_groups:
            return _part(t, 1 if what == "wo_b.weight" else 0, r, tp)
        # more ranks than groups: `share` ranks split group r // share's heads
        share = tp // n_groups
        group = _part(t, 1 if what == "wo_b.weight" else 0, r // share, n_groups)
        return _part(group, 1, r % share, share) if what == "wo_a.weight" else group
    m = _EXPERT.match(name)
    if m:
        if int(m.group(1)) not in layout.experts(n_experts):
            return SKIP
        return _part(t, 1 if m.group(2) == "w2" else 0, layout.moe_tp_rank, layout.moe_tp_size)
    m = _SHARED.match(name)
    if m:
        return _part(t, 1 if m.group(1) == "w2" else 0, layout.tp_rank, layout.tp_size)
    if name in _VOCAB and layout.vocab_parallel(_shape(t)[0]):
        return _part(t, 0, layout.attn_tp_rank, layout.attn_tp_size)
    return t
