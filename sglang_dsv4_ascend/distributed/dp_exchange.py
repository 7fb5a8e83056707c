"""Attention DP <-> MoE: the token exchange around every MoE under `--enable-dp-attention`.

With `--tp-size N --dp-size D --enable-dp-attention` each of the D attention-DP ranks (N / D
attention-TP ranks each) serves its own requests from its own caches, while the MoE layout (EP x
MoE-TP) spans all N ranks. Every MoE therefore sees every DP rank's tokens:

    gather   each DP rank's rows go to its offset in one buffer of sum(counts) rows (the other rows
             zero), summed over the TP group: every rank then holds every DP rank's rows, in DP
             rank order. Only attention-TP rank 0 of each DP group writes (its attention-TP peers
             hold the same rows after the attention all-reduce), so each row is counted once, and
             a sum of one value with zeros is exact;
    MoE      routed and shared experts on all rows, partial sums reduced over the TP group
             (layers/moe.py), identical on every rank;
    scatter  this DP rank's rows taken back from the reduced output.

`counts` are the per-DP-rank row counts of this forward, all-gathered from each rank's own count
over the TP group's CPU group (`Layout.gather_counts`: a host collective, so nothing here waits on
the device). SGLang's own counts (`global_num_tokens` of `prepare_mlp_sync_batch`) are not used:
under speculative decoding one step is a prefill forward on one DP rank and a verify forward of
draft rows on another, which SGLang counts as one row per request. Every DP rank runs exactly one
target forward per scheduler step (an idle rank an empty one), so the forwards pair up. Counts may
exceed the real rows (callers may pass padding), which this rank fills with zeros. The routing of
the token ids (hash-routed layers) is gathered once per forward.

This is SGLang's SUM_LEN exchange (`dp_attention.dp_gather_partial` / `dp_scatter`) written over
the layout's reduce function, so that the same code runs over gloo on CPU and is testable in
process; an all-gather (MAX_LEN) or reduce-scatter would move fewer bytes on a real interconnect.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch


class DPExchange:
    def __init__(
        self,
        counts: Sequence[int],
        dp_rank: int,
        real: int,
        writer: bool,
        reduce: Callable[[torch.Tensor], torch.Tensor],
    ):
        counts = [int(c) for c in counts]
        if not 0 <= dp_rank < len(counts):
            raise ValueError(f"DP exchange: dp_rank {dp_rank} outside the {len(counts)} ranks' counts {counts}")
        if not 0 <= real <= counts[dp_rank]:
            raise ValueError(f"DP exchange: {real} real rows on DP rank {dp_rank}, whose count is {counts[dp_rank]}")
        self.counts, self.dp_rank, self.real, self.writer, self.reduce = counts, dp_rank, real, writer, reduce
        self.offset = sum(counts[:dp_rank])
        self.total = sum(counts)
        self.ids = None

    @classmethod
    def for_forward(cls, layout, rows: int) -> "DPExchange | None":
        """The exchange of one model forward with `rows` rows on this rank (None without DP
        attention). Every rank's count comes from the layout's host all-gather, so each forward,
        whoever runs it (SGLang's model runner, a speculative verify, an idle rank), agrees with
        the others on the buffer's shape."""
        if layout.dp_size == 1:
            return None
        if layout.gather_counts is None:
            raise RuntimeError(f"Layout {layout.describe()}: DP attention without a gather_counts function")
        return cls(layout.gather_counts(rows), layout.dp_rank, rows, layout.attn_tp_rank == 0, layout.all_reduce)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """[real, ...] rows of this DP rank -> [total, ...] rows of every DP rank."""
        buf = x.new_zeros((self.total,) + tuple(x.shape[1:]))
        if self.writer:
            buf[self.offset : self.offset + self.real] = x[: self.real]
        return self.reduce(buf)

    def scatter(self, y: torch.Tensor) -> torch.Tensor:
        """[total, ...] -> this DP rank's [real, ...] rows."""
        return y[self.offset : self.offset + self.real]

    def bind(self, input_ids: torch.Tensor) -> "DPExchange":
        """Gather the forward's token ids once (the hash-routed MoE layers route by them)."""
        self.ids = self.gather(input_ids)
        return self

    def around(self, moe):
        """`moe(x, ids)` over every DP rank's tokens, returning this rank's rows."""
        return lambda x, ids: self.scatter(moe(self.gather(x), self.ids))
