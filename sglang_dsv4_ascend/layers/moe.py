"""DeepSeek-V4 MoE (reference §1.6).

Router (fp32): s_e = sqrt(softplus(W_gate y)_e).
Selection: hash layers take the experts tid2eid[token] of the *current input token*; other layers
take the top-k of s_e + bias_e (the bias only steers the choice).
Weights: w_k = s_{e_k} / sum_k s_{e_k} * routed_scaling_factor (unbiased scores).
Expert: silu(min(W1 y, L)) * clamp(W3 y, -L, L) -> W2, L = swiglu_limit; the shared expert uses the
same clamped SwiGLU and is added unweighted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .. import ops
from ..distributed.layout import Layout
from ..ops.reference import pad_rows
from . import SMALL_M, Linear


@torch.library.custom_op("sglang_dsv4::grouped_mm", mutates_args=())
def _grouped_mm_op(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    return torch._grouped_mm(x, w, offs=offs)


@_grouped_mm_op.register_fake
def _(x, w, offs):
    return x.new_empty(x.shape[0], w.shape[-1])


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torch._grouped_mm; traced as an opaque op, since its shape function accepts only 16-bit
    inputs while the kernel (and the fp32 test models) take fp32 too."""
    if torch.compiler.is_compiling() and x.dtype == torch.float32:
        return _grouped_mm_op(x, w, offs)
    return torch._grouped_mm(x, w, offs=offs)


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float, dtype=None, device=None):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.w1, self.w3, self.w2 = (
            Linear(dim, inter, **kw),
            Linear(dim, inter, **kw),
            Linear(inter, dim, **kw),
        )
        self.limit = limit

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return self.w2(ops.swiglu_clamped(self.w1(y), self.w3(y), self.limit))


class Gate(nn.Module):
    """Released names: `gate.weight`, and `gate.bias` (top-k layers) or `gate.tid2eid` (hash layers)."""

    def __init__(self, cfg, is_hash: bool, dtype=None, device=None):
        super().__init__()
        self.k, self.scaling, self.is_hash = cfg.num_experts_per_tok, cfg.routed_scaling_factor, is_hash
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size, dtype=dtype, device=device))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.long, device=device))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32, device=device))

    def forward(self, y: torch.Tensor, input_ids: torch.Tensor):
        """-> (expert ids [T, k], weights [T, k] fp32)."""
        # on padded rows (ops.reference.pad_rows): the fp32 scores and their softplus must round
        # the same in a verify row as in a one-row decode, or a near-tie picks another expert
        scores = ops.sqrtsoftplus(F.linear(pad_rows(y.float()), self.weight.float()))[: y.shape[0]]
        if self.is_hash:
            experts = self.tid2eid[input_ids].long()
        else:
            experts = torch.topk(scores + self.bias.float(), self.k, dim=-1).indices
        w = scores.gather(1, experts)
        return experts, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class MoE(nn.Module):
    def __init__(self, cfg, layer_id: int, dtype=None, device=None, layout: Layout | None = None):
        super().__init__()
        d, inter, lim = cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit
        self.limit = lim
        # EP / MoE-TP (distributed/layout.py): this rank's experts, keyed by their global ids (the
        # released names), each with its part of the intermediate dimension; the router is
        # replicated, the shared expert split over the TP group, partial sums reduced over it.
        self.layout = layout or Layout()
        self.local = self.layout.experts(cfg.n_routed_experts)
        part = inter // self.layout.moe_tp_size
        self.gate = Gate(cfg, cfg.hash_layers[layer_id], dtype, device)
        self.experts = nn.ModuleDict({str(e): Expert(d, part, lim, dtype, device) for e in self.local})
        n_shared = cfg.n_shared_experts
        self.shared_experts = (
            Expert(d, inter * n_shared // self.layout.tp_size, lim, dtype, device) if n_shared else None
        )
        self._stacked = None
        # torch._grouped_mm needs 16-byte-aligned row strides (and exists since torch 2.8).
        self._grouped = hasattr(torch, "_grouped_mm") and d % 8 == 0 and inter % 8 == 0

    def stack_experts(self) -> None:
        """Keep the routed experts' weights in three [E, out, in] tensors and make each expert's
        parameters views into them (no copy kept), so that all experts run as grouped matmuls.
        Done once after loading (and lazily before the first forward)."""
        stacks = []
        for name in ("w1", "w3", "w2"):
            w = torch.stack([getattr(e, name).weight.data for e in self.experts.values()])
            for i, e in enumerate(self.experts.values()):
                getattr(e, name).weight.data = w[i]
            stacks.append(w)
        self._stacked = tuple(stacks)

    def forward(self, y: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Routed experts as grouped matmuls over the token copies sorted by expert: the expert
        boundaries stay on the device (offsets), so no host sync and no per-expert Python loop.
        The combine adds each token's copies in expert order, as the per-expert definition
        (`forward_per_expert`) does."""
        if not self._grouped or (self.training and torch.is_grad_enabled()):
            # training (tools/train_tiny.py): the grouped path reads stacked copies of the weights
            # that autograd does not connect to the parameters
            return self.forward_per_expert(y, input_ids)
        # A captured graph reads the stacks it was traced with (stacked by the eager warm-up run
        # before capture), and a data-pointer test cannot be traced.
        if not torch.compiler.is_compiling():
            first = self.experts[str(self.local.start)]
            if self._stacked is None or self._stacked[0].data_ptr() != first.w1.weight.data_ptr():
                self.stack_experts()
        w1, w3, w2 = self._stacked
        experts, weights = self.gate(y, input_ids)
        T, k = experts.shape
        E = w1.shape[0]
        # Copies routed to another EP rank's experts get key E: sorted after every local group,
        # outside the grouped matmuls' offsets (their rows are left unwritten, masked below).
        flat = experts.flatten() - self.local.start
        here = (flat >= 0) & (flat < E)
        flat = torch.where(here, flat, E)
        order = torch.argsort(flat, stable=True)
        token = order // k
        # Copies per expert with a fixed-size scatter (bincount's output size depends on the data).
        counts = torch.zeros(E + 1, dtype=torch.int64, device=y.device).scatter_add_(0, flat, torch.ones_like(flat))
        offs = torch.cumsum(counts[:E], 0).to(torch.int32)
        x = y[token]
        pos = None
        if x.dtype == torch.float32:
            # An expert's 1-3 fp32 rows take the small-M kernels (layers.Linear): each group is
            # padded to >= SMALL_M rows, so a token's expert output has the same bits whatever
            # else the batch routes there. Static size (every copy + SMALL_M - 1 per expert + one
            # row for other ranks' copies); the padding rows are zeros and never read back.
            c = counts[:E]
            padded = torch.where(c > 0, c.clamp(min=SMALL_M), 0)
            key = flat[order].clamp(max=E - 1)
            rank = torch.arange(key.numel(), device=y.device) - (torch.cumsum(c, 0) - c)[key]
            size = key.numel() + (SMALL_M - 1) * E + 1
            pos = torch.where(flat[order] < E, (torch.cumsum(padded, 0) - padded)[key] + rank, size - 1)
            x = x.new_zeros(size, x.shape[1]).index_copy_(0, pos, x)
            offs = torch.cumsum(padded, 0).to(torch.int32)
        h = ops.swiglu_clamped(
            grouped_mm(x, w1.transpose(1, 2), offs),
            grouped_mm(x, w3.transpose(1, 2), offs),
            self.limit,
        )
        routed = grouped_mm(h, w2.transpose(1, 2), offs)
        if pos is not None:
            routed = routed[pos]
        routed = routed.float() * weights.flatten()[order, None]
        if self.layout.sharded:
            routed = torch.where(here[order, None], routed, 0.0)
        out = torch.zeros(y.shape, dtype=torch.float32, device=y.device).index_add_(0, token, routed)
        return self._combine(out, y)

    def _combine(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Routed + shared expert, summed over the ranks in fp32 (each holds a partial sum)."""
        if self.shared_experts is not None:
            out += self.shared_experts(y).float()
        return self.layout.all_reduce(out).to(y.dtype)

    def forward_per_expert(self, y: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The definition: loop over the experts that received tokens (host-synchronising)."""
        experts, weights = self.gate(y, input_ids)
        out = torch.zeros(y.shape, dtype=torch.float32, device=y.device)
        for e in torch.unique(experts).tolist():
            if e not in self.local:  # another EP rank's
                continue
            tok, slot = torch.where(experts == e)
            contrib = self.experts[str(e)](y[tok]).float() * weights[tok, slot, None]
            out.index_add_(0, tok, contrib)
        return self._combine(out, y)
