"""The speculative round's forwards as captured graphs: the target verify per row bucket
(VerifyGraphs), NextN's draft steps per row bucket (NextNStepGraphs), the DSpark draft block per
request bucket (DraftGraphs).

A verify forward runs every request's segment (DSpark and NextN chain: one per request, up to
seg_tokens rows; NextN tree: one per root-to-leaf path, the form a bucket takes, else the round
runs node-once and eager) with its cache writes deferred, and its
row count changes every round (adaptive budgets, trees, requests joining and leaving). Captured,
it runs at a fixed number of rows: the smallest captured bucket that holds the round, the rest
padding rows, which read no key (kvcache/plan.py: output 0) and whose deferred writes are
addressed to the scratch slot and never stored: the round stores only each segment's accepted
prefix (`cache.apply(pending, keep=...)`, outside the graph), so padding never reaches a request's
state and never changes a decision (the logits of real rows do not depend on it).

What the graph reads of the round is the bucket's persistent plan (kvcache/plan.PlanBuffers),
refreshed in place on the host before each replay, as SGLang's graph runners refresh the decode's
metadata. How a forward becomes replayable is the device's (`device.capture_graph`); a round that
fits no bucket (more rows than the largest, or a request with more committed tokens than
SGLANG_DSV4_GRAPH_CONTEXT, kvcache/plan.py) runs eager. A NextN draft step is the same kind of
forward on the draft's cache (each leaf's path from the committed length, writes discarded),
so it is captured the same way.
"""

from __future__ import annotations

import logging

import torch

from ..device import capture_meter
from ..kvcache import plan as kv_plan

logger = logging.getLogger("sglang_dsv4_ascend")


class RowGraphs:
    """A forward over rows of segments with deferred writes (a verify, a NextN draft step),
    captured per row bucket against that bucket's persistent plan on `cache`."""

    what = "forward"

    def __init__(self, cache, seg_tokens: int, rows: tuple, compile_fn=None, context: int | None = None):
        """`rows`: the buckets' row counts; `seg_tokens`: the most rows one segment has; `context`:
        the most committed tokens a request of a captured round has (kv_plan.graph_context; None:
        any), a round with a longer one runs eager."""
        if compile_fn is None:
            from ..device import capture_graph as compile_fn
        self.cache = cache
        self.context = context
        self.buckets = [kv_plan.Bucket(r, seg_tokens, context) for r in sorted(set(rows))]
        self.buffers = kv_plan.PlanBuffers(cache)
        self.fn = compile_fn(self._forward)
        self.replays, self.replayed = 0, set()
        self.holds_round = True  # the coming round's requests are within `context` (expect_round)

    def _forward(self, ids, pos, plan, pending, extra):
        raise NotImplementedError

    def _blank(self, rows: int):
        """The `extra` input of a capture (padding only)."""
        raise NotImplementedError

    def _pad(self, extra, pad: int):
        return extra

    def _trim(self, out, rows: int):
        return out[:rows]

    @torch.no_grad()  # as the rounds run: grad mode is part of what a trace is guarded on
    def capture(self, log=logger.info) -> None:
        """Trace every bucket now (startup), on a plan of padding rows only."""
        for i, b in enumerate(self.buckets):
            spent = capture_meter()
            plan = self.buffers.load([], b)
            # ids and positions distinct tensors, as in a round: aliasing is guarded on too
            ids, pos = (torch.zeros(b.rows, dtype=torch.long, device=self.cache.device) for _ in range(2))
            if i == 0:
                # one eager run first, as SGLang's runners warm up: what the model builds lazily
                # on its first forward (the MoE's stacked expert weights) must exist before the
                # trace, or the trace breaks where it is built
                self._forward(ids, pos, plan, [], self._blank(b.rows))
            for _ in range(2):  # a warm-up run, then the one that is kept
                self.fn(ids, pos, plan, [], self._blank(b.rows))
            within = "" if b.context is None else f" (contexts up to {b.context} tokens)"
            log(f"dsv4_ascend: {self.what} of {b.rows} rows captured in {spent()}{within}")

    def bucket_for(self, segments) -> kv_plan.Bucket | None:
        if any(s.parents is not None for s in segments):  # node-once trees run eager (plan.py)
            return None
        if not kv_plan.fits((s.start for s in segments), self.context):  # a longer request: eager
            return None
        T = sum(s.length for s in segments)
        longest = max((s.length for s in segments), default=0)
        return next((b for b in self.buckets if b.rows >= T and b.seg_tokens >= longest), None)

    def expect_round(self, starts) -> None:
        """The coming round's committed lengths (the engine, before planning): a round with a
        request past the buckets' context runs eager, so `rows_for` prices it at its own rows."""
        self.holds_round = kv_plan.fits(starts, self.context)

    def rows_for(self, rows: int) -> int:
        """The rows a round of `rows` rows runs at, its segments no longer than the buckets'
        (chains and DSpark blocks): the smallest bucket that holds it, or `rows` (eager: no
        bucket holds that many, or a request is past the context, expect_round). What the
        planners price a budget at (cost.Padded) and record a round at."""
        if not self.holds_round:
            return rows
        return next((b.rows for b in self.buckets if b.rows >= rows), rows)

    @torch.no_grad()  # whoever calls: a replay under grad mode would be a new trace
    def run(self, segments, ids, pos, pending: list, extra):
        """The forward's output for the real rows (padding dropped), deferred writes appended to
        `pending`; None when no bucket holds the rows (the caller runs it eager)."""
        bucket = self.bucket_for(segments)
        if bucket is None:
            return None
        plan = self.buffers.load(segments, bucket)
        pad = bucket.rows - ids.shape[0]
        ids_p = torch.cat([ids, ids.new_zeros(pad)])
        pos_p = torch.cat([pos, pos.new_zeros(pad)])
        if bucket not in self.replayed:
            self.replayed.add(bucket)
            logger.info("dsv4_ascend: first replay of the captured %s, %d rows", self.what, bucket.rows)
        self.replays += 1
        return self._trim(self.fn(ids_p, pos_p, plan, pending, self._pad(extra, pad)), ids.shape[0])


class VerifyGraphs(RowGraphs):
    """The target verify: hidden states of the round's rows; `extra` is the forward's aux dict
    (the layers whose streams the draft reads, aux["layer_ids"], and what the forward returns
    there)."""

    what = "verify"

    def __init__(self, trunk, cache, seg_tokens: int, rows: tuple, layer_ids=(), compile_fn=None, context=None):
        self.trunk, self.layer_ids = trunk, tuple(layer_ids)
        super().__init__(cache, seg_tokens, rows, compile_fn, context)

    def _forward(self, ids, pos, plan, pending, aux):
        return self.trunk(ids, pos, (), self.cache, pending=pending, aux=aux, plan=plan)

    def _blank(self, rows):
        return {"layer_ids": self.layer_ids}


class NextNStepGraphs(RowGraphs):
    """A NextN draft step (models/nextn.NextN.step over every leaf's path, writes discarded) on
    the draft's own cache: (hidden, output streams) of the real rows; `extra` is the rows' input
    streams X_i, padded with zeros (padding rows read no key and their writes are dropped)."""

    what = "NextN draft step"

    def __init__(self, nextn, cache, embed, seg_tokens: int, rows: tuple, state_dtype=None, compile_fn=None):
        self.nextn, self.embed = nextn, embed
        cfg = nextn.cfg
        self.state_shape, self.dtype = (cfg.hc_mult, cfg.hidden_size), state_dtype or nextn.dtype
        super().__init__(cache, seg_tokens, rows, compile_fn)

    def _forward(self, ids, pos, plan, pending, states):
        return self.nextn.step(ids, states, pos, (), self.cache, self.embed, pending=pending, plan=plan)

    def _blank(self, rows):
        return torch.zeros(rows, *self.state_shape, dtype=self.dtype, device=self.cache.device)

    def _pad(self, states, pad):
        return torch.cat([states, states.new_zeros(pad, *states.shape[1:])])

    def _trim(self, out, rows):
        return out[0][:rows], out[1][:rows]


class DraftGraphs:
    """The DSpark draft block (models/dspark.DSparkDraft.block_forward: three stages and the head
    over n requests x gamma rows) captured per request bucket. A batch pads to the smallest
    bucket that holds it with requests in the rings' scratch slot at position 0: their context
    keys are all invalid (positions < 0), they attend their own block only, and their rows are
    dropped; a real request's rows read its own context and block alone, so padding changes none
    of its logits. Each bucket's inputs (ids, positions, key rows and validity) live in buffers
    filled in place before a replay, as a device graph reads them; the rings are the draft
    cache's own. The graph ends with the greedy Markov chain and its confidences
    (DSparkDraft.markov_greedy, from the anchors in each block's first id); a round with a sampled
    request runs the chain eager after the block instead (its draws are on the host)."""

    def __init__(self, draft, cache, gamma: int, sizes, embed, head, compile_fn=None):
        if compile_fn is None:
            from ..device import capture_graph as compile_fn
        self.draft, self.cache, self.gamma, self.embed, self.head = draft, cache, gamma, embed, head
        self.sizes = sorted(set(sizes))
        self.inputs = {}  # bucket (requests) -> its buffers
        self.fn = compile_fn(self._forward)
        self.replays, self.replayed = 0, set()

    def _forward(self, ids, positions, key_rows, key_ok):
        U, h = self.draft.block_forward(ids, positions, key_rows, key_ok, self.cache.rings, self.embed, self.head)
        n = ids.shape[0] // self.gamma
        x, c = self.draft.markov_greedy(U.view(n, self.gamma, -1), h.view(n, self.gamma, -1), ids[:: self.gamma])
        return U, h, x, c

    def _load(self, n: int, slots, starts, anchors: torch.Tensor):
        pad = n - len(slots)
        scratch = self.cache.rings.shape[1] - 1
        anchors = torch.cat([anchors, anchors.new_zeros(pad)])
        fresh = self.draft.block_inputs(
            self.cache, list(slots) + [scratch] * pad, list(starts) + [0] * pad, anchors, self.gamma
        )
        bufs = self.inputs.setdefault(n, fresh)
        if bufs is not fresh:
            for buf, new in zip(bufs, fresh):
                buf.copy_(new)
        return bufs

    @torch.no_grad()
    def capture(self, log=logger.info) -> None:
        for i, n in enumerate(self.sizes):
            spent = capture_meter()
            bufs = self._load(n, [], [], torch.zeros(0, dtype=torch.long, device=self.cache.rings.device))
            if i == 0:  # an eager run first: what the stages build lazily exists before the trace
                self._forward(*bufs)
            for _ in range(2):
                self.fn(*bufs)
            log(f"dsv4_ascend: DSpark draft block of {n} requests captured in {spent()}")

    @torch.no_grad()
    def run(self, slots, starts, anchors: torch.Tensor):
        """(U [n, gamma, V], h [n, gamma, d]) as DSparkDraft.block returns them, then the greedy
        chain (x [n, gamma], c [n, gamma]) as DSparkDraft.markov_greedy returns it; None when no
        bucket holds the batch (the caller runs it eager)."""
        n = next((b for b in self.sizes if b >= len(slots)), None)
        if n is None:
            return None
        if n not in self.replayed:
            self.replayed.add(n)
            logger.info("dsv4_ascend: first replay of the captured DSpark draft, %d requests", n)
        self.replays += 1
        U, h, x, c = self.fn(*self._load(n, slots, starts, anchors))
        k, rows = len(slots), len(slots) * self.gamma
        return U[:rows].view(k, self.gamma, -1), h[:rows].view(k, self.gamma, -1), x[:k], c[:k]
