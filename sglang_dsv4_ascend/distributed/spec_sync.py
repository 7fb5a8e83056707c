"""Speculative decisions agree on every rank, by construction, and a switch that checks it.

Under TP / EP every rank runs the speculative worker on the same batch. If one rank accepted two
candidates and another three, their caches would diverge and the next forward would mix garbage
(or hang in a collective with mismatched shapes). How each decision is made identical:

  * draft tokens and the NextN tree: the draft models are replicated (distributed/layout.py) and
    read the target's streams after its last all-reduce, which a collective returns bit-identical
    on every rank; the drafter's own draws (DSpark's Markov sampling) use the worker's generator,
    seeded with --random-seed on every rank and drawn in the same order;
  * the adaptive verify budget (DSpark): the confidences are computed as above; the verify cost
    model is measured on every rank (its forwards contain collectives, so all ranks must run the
    same number: the measuring loop's stop is agreed with `any`) and rank 0's fit is broadcast;
  * accept lengths, accepted paths and bonus tokens: from the target logits (the head over the
    all-reduced hidden state, its vocab-parallel columns all-gathered: the same bits on every rank)
    and the identically seeded generator.

Under DP attention (`--enable-dp-attention`) each DP group serves its own requests: the decisions
above agree within its attention-TP group, which the check compares; the DP groups meet only in
the target forward's MoE exchange (distributed/dp_exchange.py), one per scheduler step on every
rank (an idle or prefilling rank runs its own forward while another verifies).

`SGLANG_DSV4_SPEC_SYNC_CHECK=1` all-gathers each round's decisions over the attention-TP group's
CPU group and stops the server with an error naming the round, the decision and the ranks if they differ.
`SGLANG_DSV4_DEBUG_DESYNC_RANK=R` (tests only) offsets rank R's accept seed, the deliberately broken
variant the check must catch.
"""

from __future__ import annotations

import torch

from .. import settings
from .layout import sglang_parallel_state


class DesyncError(RuntimeError):
    pass


class RankSync:
    """Host-side agreement over SGLang's TP group (gloo CPU group). One rank: every call is local."""

    def __init__(self, group=None, rank: int = 0, size: int = 1, check: bool | None = None):
        self.group, self.rank, self.size = group, rank, size
        self.checking = settings.SPEC_SYNC_CHECK.get() if check is None else check
        self.rounds = 0

    @classmethod
    def from_sglang(cls, attention: bool = False) -> "RankSync":
        """Over SGLang's TP group, or (`attention`) its attention-TP group: the ranks that serve
        the same requests, whose decisions must agree (under DP attention each DP group decides
        for its own requests; without it the two groups are the same)."""
        ps = sglang_parallel_state()
        if ps is None:
            return cls()
        tp = ps.get_attn_tp_group() if attention else ps.get_tp_group()
        if tp.world_size == 1:
            return cls()
        return cls(tp.cpu_group, tp.rank_in_group, tp.world_size)

    def seed(self, seed: int) -> int:
        """The accept generator's seed on this rank: --random-seed everywhere (the debug variant
        offsets one rank's)."""
        broken = settings.DEBUG_DESYNC_RANK.get()
        return seed + 1 if broken is not None and broken == self.rank and self.size > 1 else seed

    def any(self, flag: bool) -> bool:
        """True on every rank if it is true on one (e.g. "this rank's time budget is spent")."""
        if self.size == 1:
            return flag
        t = torch.tensor([int(bool(flag))])
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX, group=self.group)
        return bool(t.item())

    def broadcast(self, obj):
        """Rank 0's `obj` on every rank."""
        if self.size == 1:
            return obj
        box = [obj]
        torch.distributed.broadcast_object_list(box, src=self._global(0), group=self.group)
        return box[0]

    def _global(self, rank_in_group: int) -> int:
        return torch.distributed.get_global_rank(self.group, rank_in_group)

    def check(self, decisions: dict) -> None:
        """With the check on: every rank's `decisions` of this round equal, else DesyncError."""
        self.rounds += 1
        if not self.checking or self.size == 1:
            return
        everyone = [None] * self.size
        torch.distributed.all_gather_object(everyone, decisions, group=self.group)
        diff = first_difference(everyone)
        if diff is not None:
            key, a, b = diff
            raise DesyncError(
                f"{settings.SPEC_SYNC_CHECK.name}: speculative decisions differ across TP ranks at round "
                f"{self.rounds}: {key!r} is "
                f"{everyone[a][key]} on rank {a} and {everyone[b][key]} on rank {b}; the caches of these ranks have "
                "diverged (same --random-seed on every rank? replicated draft weights?)"
            )


def first_difference(per_rank: list[dict]):
    """(decision name, rank a, rank b) of the first decision on which two ranks differ, or None."""
    ref = per_rank[0]
    for key in ref:
        for r, other in enumerate(per_rank[1:], 1):
            if other.get(key) != ref[key]:
                return key, 0, r
    return None
