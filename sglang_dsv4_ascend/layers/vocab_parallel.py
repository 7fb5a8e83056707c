"""Embedding and LM head split by vocabulary rows over the attention-TP group (distributed/layout.py
says when and why).

    embed(x)  = sum over ranks r of  E_r[x - v_r]  if v_r <= x < v_r + V/n  else 0    (all-reduce)
    logits(h) = [h E'_0^T | h E'_1^T | ... | h E'_{n-1}^T]                              (all-gather)

Exactly one rank holds a token's row, so the all-reduce adds zeros to it: the sum is that row, in
any order and any dtype. The gathered logits are the same bits on every rank (a collective returns
one result), so everything decided from them (sampling, speculative accepts) agrees across ranks.
Both keep the released parameter names (`embed.weight`, `head.weight`) with this rank's rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..distributed.layout import Layout
from ..ops.reference import pad_rows
from . import SMALL_M


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, dim: int, layout: Layout, dtype=None, device=None):
        rows = layout.vocab_rows(vocab_size)
        super().__init__(len(rows), dim, dtype=dtype, device=device)
        self.vocab_size, self.first, self.layout = vocab_size, rows.start, layout

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.first
        here = (local >= 0) & (local < self.num_embeddings)
        rows = F.embedding(torch.where(here, local, 0), self.weight)
        return self.layout.attn_all_reduce(torch.where(here.unsqueeze(-1), rows, 0))

    def extra_repr(self) -> str:
        rows = f"[{self.first}, {self.first + self.num_embeddings})"
        return f"vocab rows {rows} of {self.vocab_size}, dim {self.embedding_dim}"


def head_matmul(hidden: torch.Tensor, weight: torch.Tensor, fp32: bool = False) -> torch.Tensor:
    """Logit columns computed as SGLang's LogitsProcessor computes a plain head's
    (`_compute_lm_head`: `matmul(hidden.to(w.dtype), w.T)`, or in fp32 under --enable-fp32-lm-head
    or for an fp32 model). Every logit the plugin computes itself -- speculative verify, drafts,
    vocab-parallel columns -- goes through here, so a bf16 server rounds each row exactly as the
    served head does without speculation, and greedy output cannot change at a near-tie. The cost:
    bf16 logits are rounded to bf16 (as the served head's are); fp32 would be closer to exact but
    would differ from the non-speculative path, and losslessness is judged against that path."""
    dtype = torch.float32 if fp32 or hidden.dtype == torch.float32 else weight.dtype
    rows = hidden.shape[0]
    if dtype == torch.float32 and hidden.dim() == 2 and 0 < rows < SMALL_M:  # as layers.Linear
        return torch.matmul(pad_rows(hidden.to(dtype)), weight.to(dtype).T)[:rows]
    return torch.matmul(hidden.to(dtype), weight.to(dtype).T)


def head_logits(
    head: nn.Linear, hidden: torch.Tensor, layout: Layout, vocab_size: int, fp32: bool = False
) -> torch.Tensor:
    """fp32 logits [T, vocab] from `head` (this rank's vocabulary rows when vocab-parallel), with
    the served head's rounding (head_matmul)."""
    local = head_matmul(hidden, head.weight, fp32)
    return (layout.attn_all_gather(local) if layout.vocab_parallel(vocab_size) else local).float()


class GatheredHead:
    """What SGLang's LogitsProcessor is given as the lm_head of a vocab-parallel model: the
    processor computes logits through a head's `quant_method.apply(layer, hidden, bias)` when it
    has one, so it receives the full gathered logits (its own gather stays off: our group is the
    attention-TP group, under DP attention too) and does the rest (logprobs, hidden states) as
    usual. A plain object, not a module: SGLang's loader never sees it.

    The local columns are computed as the processor computes a plain head's: in the weight's dtype,
    or in fp32 when it hands fp32 hidden states (--enable-fp32-lm-head, or an fp32 model). So a
    vocab-parallel server rounds its logits as a one-rank server does, and a bf16 head is not
    copied to fp32 on every forward."""

    def __init__(self, head: nn.Linear, layout: Layout):
        self.head, self.layout, self.quant_method = head, layout, self

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight

    def apply(self, layer, hidden: torch.Tensor, bias=None) -> torch.Tensor:
        if bias is not None:
            raise ValueError("DeepSeek-V4's LM head has no bias")
        return self.layout.attn_all_gather(head_matmul(hidden, self.head.weight))
