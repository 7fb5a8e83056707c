"""The target verify of a speculative round as a captured graph, one per row bucket.

A verify forward runs every request's segment (DSpark and NextN chain: one per request, up to
seg_tokens rows; NextN tree: one per root-to-leaf path) with its cache writes deferred, and its
row count changes every round (adaptive budgets, trees, requests joining and leaving). Captured,
it runs at a fixed number of rows: the smallest captured bucket that holds the round, the rest
padding rows, which read no key (kvcache/plan.py: output 0) and whose deferred writes are
addressed to the scratch slot and never stored: the round stores only each segment's accepted
prefix (`cache.apply(pending, keep=...)`, outside the graph), so padding never reaches a request's
state and never changes a decision (the logits of real rows do not depend on it).

What the graph reads of the round is the bucket's persistent plan (kvcache/plan.PlanBuffers),
refreshed in place on the host before each replay, as SGLang's graph runners refresh the decode's
metadata. How a forward becomes replayable is the device's (`device.capture_graph`); a round that
fits no bucket runs eager.
"""

from __future__ import annotations

import logging
import time

import torch

from ..kvcache import plan as kv_plan

logger = logging.getLogger("sglang_dsv4_ascend")


class VerifyGraphs:
    def __init__(self, trunk, cache, seg_tokens: int, rows: tuple, layer_ids=(), compile_fn=None):
        """`rows`: the buckets' row counts; `seg_tokens`: the most rows one segment has (the verify
        width); `layer_ids`: the layers whose streams the draft reads (aux["layer_ids"])."""
        if compile_fn is None:
            from ..device import capture_graph as compile_fn
        self.trunk, self.cache, self.layer_ids = trunk, cache, tuple(layer_ids)
        self.buckets = [kv_plan.Bucket(r, seg_tokens) for r in sorted(set(rows))]
        self.buffers = kv_plan.PlanBuffers(cache)
        self.fn = compile_fn(self._forward)
        self.replays, self.replayed = 0, set()

    def _forward(self, ids, pos, plan, pending, aux):
        return self.trunk(ids, pos, (), self.cache, pending=pending, aux=aux, plan=plan)

    @torch.no_grad()  # as the rounds run: grad mode is part of what a trace is guarded on
    def capture(self, log=logger.info) -> None:
        """Trace every bucket now (startup), on a plan of padding rows only."""
        for i, b in enumerate(self.buckets):
            tic = time.perf_counter()
            plan = self.buffers.load([], b)
            # ids and positions distinct tensors, as in a round: aliasing is guarded on too
            ids, pos = (torch.zeros(b.rows, dtype=torch.long, device=self.cache.device) for _ in range(2))
            aux = {"layer_ids": self.layer_ids}
            if i == 0:
                # one eager run first, as SGLang's runners warm up: what the model builds lazily
                # on its first forward (the MoE's stacked expert weights) must exist before the
                # trace, or the trace breaks where it is built
                self._forward(ids, pos, plan, [], dict(aux))
            for _ in range(2):  # a warm-up run, then the one that is kept
                self.fn(ids, pos, plan, [], dict(aux))
            log(f"dsv4_ascend: verify of {b.rows} rows captured in {time.perf_counter() - tic:.1f} s")

    def bucket_for(self, segments) -> kv_plan.Bucket | None:
        T = sum(s.length for s in segments)
        longest = max((s.length for s in segments), default=0)
        return next((b for b in self.buckets if b.rows >= T and b.seg_tokens >= longest), None)

    def rows_for(self, rows: int) -> int:
        """The rows a round of `rows` rows runs at, its segments no longer than the buckets'
        (chains and DSpark blocks): the smallest bucket that holds it, or `rows` (eager). What
        the DSpark planner prices a budget at (cost.Padded)."""
        return next((b.rows for b in self.buckets if b.rows >= rows), rows)

    @torch.no_grad()  # whoever calls: a replay under grad mode would be a new trace
    def run(self, segments, ids, pos, pending: list, aux: dict):
        """Hidden states of the round's rows (padding dropped), deferred writes appended to
        `pending`; None when no bucket holds the round (the caller runs it eager)."""
        bucket = self.bucket_for(segments)
        if bucket is None:
            return None
        plan = self.buffers.load(segments, bucket)
        pad = bucket.rows - ids.shape[0]
        ids_p = torch.cat([ids, ids.new_zeros(pad)])
        pos_p = torch.cat([pos, pos.new_zeros(pad)])
        if bucket not in self.replayed:
            self.replayed.add(bucket)
            logger.info("dsv4_ascend: first replay of the captured verify, %d rows", bucket.rows)
        self.replays += 1
        return self.fn(ids_p, pos_p, plan, pending, aux)[: ids.shape[0]]
