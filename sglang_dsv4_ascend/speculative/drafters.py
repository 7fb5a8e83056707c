"""Drafters: the checkpoint's NextN block, its DSpark draft, and a test-only replay drafter.

A drafter is built with the engine (engine.SpecEngine: model, target cache, shape, generator) and
owns its own state (draft caches, per-slot draft state). It has `extend(segments, next_tokens, aux,
rows, finals)` (called after every target forward that commits rows: prefill chunks and accepted
verify rows; `aux` is that forward's captured streams) and `draft(slots, starts, bonus, histories,
sampling) -> [DraftTree] | engine.Drafts`.
"""

from __future__ import annotations

import json
import logging

import torch

from .. import settings
from ..batch import Segment
from ..kvcache import plan as kv_plan
from ..kvcache.prefix_state import boundaries_of
from .accept import sampled_temperature
from .engine import Drafts
from .tree import DraftTree, TreeBuilder

logger = logging.getLogger("sglang_dsv4_ascend")


def make_drafter(engine):
    """The checkpoint's drafter for the engine (DSpark when the engine has a block size `gamma`,
    else NextN), or the replay test drafter when SGLANG_DSV4_TEST_DRAFTER asks for it (refused
    unless SGLANG_DSV4_TESTING is on: settings.py)."""
    spec = settings.TEST_DRAFTER.get()
    if not spec:
        return DSparkDrafter(engine) if hasattr(engine, "gamma") else NextNDrafter(engine)
    kind, _, arg = spec.partition(":")
    if kind != "replay" or not arg:
        raise ValueError(
            f"{settings.TEST_DRAFTER.name}={spec!r}: expected 'replay:FILE' (a test-only drafter) or unset"
        )
    logger.warning(
        "dsv4_ascend: %s=%s: the TEST replay drafter proposes tokens from %s instead of the "
        "checkpoint's draft; outputs stay lossless, acceptance and speed figures are synthetic",
        settings.TEST_DRAFTER.name,
        spec,
        arg,
    )
    return ReplayDrafter(engine, arg)


def _positions(segments, device):
    return torch.cat([torch.arange(s.start, s.start + s.length) for s in segments]).to(device)


class _Deferred:
    """A request's committed rows whose NextN extend is put off (plain rounds): from `start`, the
    token after each and the target's streams at it."""

    def __init__(self, start: int):
        self.start, self.tokens, self.streams = start, [], []

    @property
    def end(self) -> int:
        return self.start + sum(len(t) for t in self.tokens)


class NextNDrafter:
    """Drafts with the NextN block (models/nextn.py), chained: a step's output streams are the next
    step's state. Draft probabilities are the block's softmax at temperature 1; children are its
    top-k (deterministic proposals, which the accept rules treat as point masses)."""

    name = "nextn"
    # Plain rounds (the guard's, the round shapes' "plain") defer their extend: a NextN step costs
    # about what one trunk layer costs, which made a plain round 10-15 % dearer than a decode step
    # without speculation (trained tiny model, 16 requests). Deferred rows run as one batched step
    # when the request drafts again, when it has DEFER_ROWS of them, and at a page boundary with
    # prefix states on (the draft's state there is saved in the round the target's is, as before).
    defers = True
    DEFER_ROWS = 16

    def __init__(self, engine):
        self.w = w = engine
        self.deferred: dict = {}  # slot -> _Deferred
        cfg, cache = w.model.cfg, w.cache
        self.draft_cache = w.model.nextn.make_cache(
            cache.num_slots, cache.max_context_len, cache.spec_slack, device=w.device
        )
        # per slot: the logits and output streams of the draft's last committed row
        self.root_logits = torch.zeros(cache.num_slots, cfg.vocab_size, dtype=torch.float32, device=w.device)
        self.root_streams = torch.zeros(
            cache.num_slots, cfg.hc_mult, cfg.hidden_size, dtype=w.model.model.dtype, device=w.device
        )

    def enable_prefix(self, target_states) -> None:
        """Prefix hits: the NextN layer's window rows go into a store linked to the target's (same
        keys and indices). Its row p reads token p + 1; SGLang's tree keys EAGLE prefixes by token
        pairs, so a hit at L also shares token L and every row < L is the request's own."""
        self.draft_cache.enable_prefix_states(
            target_states.capacity, target_states.page, link=target_states, key_slots=self.w.cache.token_slots
        )

    def restore(self, slot: int, length: int) -> None:
        self.deferred.pop(slot, None)  # a new request in the slot: what its predecessor left
        self.draft_cache.restore_prefix(slot, length)

    def _step(self, ids, states, segments, pending=None):
        w = self.w
        graphs = getattr(w, "draft_graphs", None)
        if graphs is not None and pending is not None:  # a draft step (writes discarded) captured
            out = graphs.run(segments, ids, _positions(segments, w.device), pending, states)
            if out is not None:
                return out
        return w.model.nextn.step(
            ids,
            states,
            _positions(segments, w.device),
            segments,
            self.draft_cache,
            w.model.model.embed,
            pending=pending,
        )

    def extend(self, segments, next_tokens, aux, rows, finals, defer: bool = False):
        """Store the draft rows of committed positions; `finals` (b, row): requests whose last row
        is the draft state of their next round. `defer`: put them off (a plain round, class
        docstring): each segment must end in its final row."""
        if not segments:
            return
        streams = aux["streams"] if rows is None else aux["streams"][rows]
        if defer:
            self._defer(segments, next_tokens, streams)
            return
        # rows put off for these requests go first; a slot whose put-off rows do not lead up to
        # its segment holds another request now (a new prompt, a retraction): they are dropped
        due = [s.slot for s in segments if s.slot in self.deferred and self.deferred[s.slot].end == s.start]
        for s in segments:
            if s.slot in self.deferred and s.slot not in due:
                del self.deferred[s.slot]
        self.catch_up(due)
        self._extend(segments, next_tokens, streams, finals)

    def _defer(self, segments, next_tokens, streams) -> None:
        prefix, off, due = self.draft_cache.prefix, 0, []
        for s in segments:
            d = self.deferred.get(s.slot)
            if d is None or d.end != s.start:
                d = self.deferred[s.slot] = _Deferred(s.start)
            d.tokens.append(next_tokens[off : off + s.length])
            d.streams.append(streams[off : off + s.length])
            off += s.length
            n = d.end - d.start
            crossed = prefix is not None and (s.start + s.length) // prefix.page > s.start // prefix.page
            if n >= self.DEFER_ROWS or crossed:
                due.append(s.slot)
        self.catch_up(due)

    def catch_up(self, slots=None) -> None:
        """Run the extend put off for these requests (all: None), as one batched step."""
        wanted = list(self.deferred) if slots is None else dict.fromkeys(slots)
        todo = [(s, self.deferred.pop(s)) for s in wanted if s in self.deferred]
        if not todo:
            return
        segments, finals, off = [], [], 0
        for b, (slot, d) in enumerate(todo):
            segments.append(Segment(slot, d.start, d.end - d.start))
            off += d.end - d.start
            finals.append((b, off - 1))
        tokens = torch.cat([t for _, d in todo for t in d.tokens])
        streams = torch.cat([x for _, d in todo for x in d.streams])
        self._extend(segments, tokens, streams, finals)

    def _extend(self, segments, next_tokens, streams, finals) -> None:
        w = self.w
        hidden, out = self._step(next_tokens, streams, segments)
        if finals:
            rows = torch.tensor([r for _, r in finals], device=w.device)
            slots = torch.tensor([segments[b].slot for b, _ in finals], device=w.device)
            self.root_logits[slots] = w.model.model.compute_logits(hidden[rows])
            self.root_streams[slots] = out[rows].to(self.root_streams.dtype)

    def request_row_tensors(self) -> list:
        """The draft state of each request slot, for PD: the draft cache's rings and the last
        committed row's logits and streams."""
        self.catch_up()
        return self.draft_cache.slot_tensors() + [self.root_logits, self.root_streams]

    def draft(self, slots, starts, bonus, histories=None, sampling=None):
        w = self.w
        self.catch_up(slots)
        builders = [TreeBuilder(b, w.topk) for b in bonus]
        probs0 = torch.softmax(self.root_logits[torch.tensor(slots, device=w.device)], dim=-1)
        leaves = [bld.step(probs0[i : i + 1]) for i, bld in enumerate(builders)]
        # incremental unless the steps are captured (a bucket holds paths) or paths are asked for
        if getattr(w, "draft_graphs", None) is not None or not getattr(w, "node_once", True):
            self._paths(slots, starts, builders, leaves)
        else:
            self._frontiers(slots, starts, builders, leaves)
        return [bld.finish(w.num_draft_tokens)[0] for bld in builders]

    def _frontiers(self, slots, starts, builders, leaves):
        """Steps 2.. computing only each step's new leaves: one tree segment per request whose
        earlier candidates (the leaves' ancestors) are past nodes keyed from the rows earlier
        steps computed (Segment.past, plan.past_kv), so each candidate is computed once."""
        w, dev = self.w, self.w.device
        streams = [{} for _ in slots]  # per request: candidate id -> the draft's output streams at it
        past_kv, past_row = None, [{} for _ in slots]  # candidate -> its key row in past_kv
        for _ in range(1, w.num_steps):
            segs, ids, states = [], [], []
            for i, (slot, L, bld) in enumerate(zip(slots, starts, builders)):
                new = leaves[i]
                old = sorted({a for c in new for a in bld.cands_of(c)[:-1]})  # ids: parents first
                node = {c: k for k, c in enumerate(old + new)}
                parents = tuple(node.get(bld.parent_of(c), -1) for c in old + new)
                segs.append(Segment(slot, L, len(new), parents, tuple(past_row[i][c] for c in old)))
                for c in new:
                    ids.append(bld.token_of(c))
                    p = bld.parent_of(c)
                    states.append(self.root_streams[slot] if p < 0 else streams[i][p])
            plan = kv_plan.build_plan(segs, self.draft_cache, device=dev)
            if past_kv is not None:
                plan.past_kv = {0: past_kv}
            pending = []
            positions = torch.cat([s.start + torch.tensor(s.depths()) for s in segs]).to(dev)
            hidden, out = w.model.nextn.step(
                torch.tensor(ids, device=dev),
                torch.stack(states),
                positions,
                segs,
                self.draft_cache,
                w.model.model.embed,
                pending=pending,
                plan=plan,
            )
            kv = pending[0].swa
            base = 0 if past_kv is None else past_kv.shape[0]
            past_kv = kv if past_kv is None else torch.cat([past_kv, kv])
            probs = torch.softmax(w.model.model.compute_logits(hidden), dim=-1)
            row, first = 0, []
            for i, new in enumerate(leaves):
                first.append(row)
                for c in new:
                    streams[i][c], past_row[i][c] = out[row], base + row
                    row += 1
            first.append(row)
            leaves = [bld.step(probs[first[i] : first[i + 1]]) for i, bld in enumerate(builders)]

    def _paths(self, slots, starts, builders, leaves):
        """Steps 2.. path by path: one segment per current leaf over its whole candidate path."""
        w, root_streams = self.w, self.root_streams
        streams = [{} for _ in slots]  # per request: candidate id -> the draft's output streams at it
        for _ in range(1, w.num_steps):
            segs, ids, states, last, owner = [], [], [], [], []
            for i, (slot, L, bld) in enumerate(zip(slots, starts, builders)):
                for c in leaves[i]:
                    cands = bld.cands_of(c)
                    segs.append(Segment(slot, L, len(cands)))
                    ids += bld.tokens_of(c)
                    states += [root_streams[slot]] + [streams[i][x] for x in cands[:-1]]
                    last.append(len(ids) - 1)
                    owner.append((i, c))
            hidden, out = self._step(torch.tensor(ids, device=w.device), torch.stack(states), segs, pending=[])
            rows = torch.tensor(last, device=w.device)
            probs = torch.softmax(w.model.model.compute_logits(hidden[rows]), dim=-1)
            by_req = [[] for _ in slots]
            for k, (i, c) in enumerate(owner):
                streams[i][c] = out[last[k]]
                by_req[i].append(k)
            leaves = [bld.step(probs[by_req[i]]) for i, bld in enumerate(builders)]


class DSparkDrafter:
    """Drafts a chain of gamma tokens per request with the DSpark draft (models/dspark.py): one
    block forward over [anchor, noise...] against the injected context, then the Markov head left
    to right at the request's temperature (argmax when greedy). Returns the chains, the
    distributions q_k = softmax(z_k / T) the sampled drafts were drawn from, and the confidences
    c_k (the planner's input)."""

    name = "dspark"

    def __init__(self, engine):
        self.w = w = engine
        self.net = w.model.dspark
        self.layer_ids = tuple(w.model.cfg.dspark_target_layer_ids)
        self.ctx = self.net.make_cache(w.cache.num_slots, w.cache.spec_slack, device=w.device)
        self.states = None  # the target's prefix states, when prefix hits are on

    def enable_prefix(self, target_states) -> None:
        """Prefix hits: each stage's injected context rows [b - W, b) are kept with the target's
        state at boundary b (they depend on the target features of positions < b only)."""
        self.states = target_states
        rings = self.ctx.rings
        target_states.extras["dspark_ctx"] = torch.zeros(
            target_states.capacity,
            rings.shape[0],
            self.ctx.window,
            rings.shape[-1],
            dtype=rings.dtype,
            device=rings.device,
        )

    def restore(self, slot: int, length: int) -> None:
        idx = self.states.lookup(int(self.w.cache.token_slots[slot, length - 1]), length)
        if idx is None:
            raise RuntimeError(f"dsv4_ascend DSpark: no prefix state for slot {slot} at {length}")
        q = torch.arange(length - self.ctx.window, length, device=self.w.device)
        ok = q >= 0
        self.ctx.rings[:, slot, q[ok] % self.ctx.ring] = self.states.extras["dspark_ctx"][idx][:, ok]

    def _save_states(self, segments):
        """Gather lists of the context rows of the boundaries this extend completes: per state, for
        each position its row among the new ones or its ring row (read before the injection)."""
        segs, off = [], 0
        for s in segments:
            segs.append((s.slot, s.start, s.length, off))
            off += s.length
        found = boundaries_of(self.states, segs)
        keys = [int(self.w.cache.token_slots[slot, b - 1]) for slot, _, _, b in found]
        idx = [self.states.lookup(k, b) for k, (_, _, _, b) in zip(keys, found)]
        found = [(f, i) for f, i in zip(found, idx) if i is not None]
        if not found:
            return None
        W, R = self.ctx.window, self.ctx.ring
        t = torch.tensor([[slot, start, first, b] for (slot, start, first, b), _ in found])
        q = t[:, 3:4] - W + torch.arange(W)
        take_new = q >= t[:, 1:2]
        new = (t[:, 2:3] + q - t[:, 1:2]).clamp(min=0)
        ring = t[:, 0:1] * R + q.clamp(min=0) % R
        dev = self.w.device
        return (
            torch.tensor([i for _, i in found], device=dev),
            take_new.to(dev),
            new.to(dev),
            ring.to(dev),
            (q >= 0).to(dev),
        )

    def request_row_tensors(self) -> list:
        """The draft state of each request slot, for PD: every stage's context ring."""
        return list(self.ctx.rings.unbind(0))

    def extend(self, segments, next_tokens, aux, rows, finals):
        """Inject the target features of every committed row into each stage's ring."""
        if not segments:
            return
        feat = self.net.features(aux["layer_streams"], rows)
        slots = torch.cat([torch.full((s.length,), s.slot, dtype=torch.long) for s in segments]).to(self.w.device)
        saver = self._state_saver(segments) if self.states is not None else None
        self.net.inject(self.ctx, feat, slots, _positions(segments, self.w.device), before_store=saver)

    def _state_saver(self, segments):
        """inject's `before_store`: copies each stage's window rows of the boundaries this extend
        completes into the prefix states (None when it completes none)."""
        lists = self._save_states(segments)
        if lists is None:
            return None
        idx, take_new, new, ring, valid = lists
        dst = self.states.extras["dspark_ctx"]

        def save(stage, kv, ring_rows):
            old = ring_rows.view(-1, ring_rows.shape[-1])[ring]
            rows = torch.where(take_new[..., None], kv[new].to(old.dtype), old)
            dst[idx, stage] = torch.where(valid[..., None], rows, 0).to(dst.dtype)

        return save

    @torch.no_grad()
    def draft(self, slots, starts, bonus, histories=None, sampling=None):
        w, d, gamma = self.w, self.net, self.w.gamma
        trunk = w.model.model
        anchors = torch.tensor(bonus, dtype=torch.long, device=w.device)
        graphs = getattr(w, "draft_graphs", None)
        blocks = None if graphs is None else graphs.run(slots, starts, anchors)
        temps = [sampled_temperature(sp, b) for b, sp in enumerate(sampling or [None] * len(slots))]
        if blocks is None:
            blocks = d.block(self.ctx, slots, starts, anchors, gamma, trunk.embed, trunk.compute_logits)
        if len(blocks) == 4 and all(t is None for t in temps):  # the captured graph ran the greedy chain
            x, probs, conf = blocks[2], None, blocks[3]
        else:
            x, probs, conf = d.markov_chain(blocks[0], blocks[1], anchors, temps, w.generator)
        trees = [DraftTree([b] + c, list(range(-1, gamma))) for b, c in zip(bonus, x.tolist())]
        return Drafts(trees, probs if any(t is not None for t in temps) else None, conf)


class ReplayDrafter:
    """TEST ONLY (`SGLANG_DSV4_TEST_DRAFTER=replay:FILE`): proposes the known continuation of each
    request, with errors injected where the file says, so that end-to-end tests drive full,
    partial and zero acceptance through a real server (random weights almost never accept).

    FILE (JSON): {"sequences": [[token ids: prompt + reference completion], ...], "mode": M} or
                 "modes": [M per sequence] (one server drives several acceptance patterns)
      M = "full"       every proposal correct
          "zero"       the first proposal wrong
          "partial:k"  the first k proposals correct, then wrong
          "sibling"    (trees) the correct token is always the second child, a wrong one the first
          "cycle"      full, partial:1, zero in turn, round by round per request
    The tree is still built by TreeBuilder (from synthetic draft probabilities), so tree shape,
    ordering and commit go through the production path; the draft cache is not used."""

    name = "replay"

    def __init__(self, engine, path):
        self.w = engine
        with open(path) as f:
            spec = json.load(f)
        self.sequences = [list(map(int, s)) for s in spec["sequences"]]
        self.modes = spec.get("modes") or [spec.get("mode", "full")] * len(self.sequences)
        if len(self.modes) != len(self.sequences):
            raise ValueError(f"replay drafter {path}: {len(self.modes)} modes for {len(self.sequences)} sequences")
        for m in set(self.modes):
            self._correct_depth(m, 0)  # an unknown mode fails at startup
        self.vocab = engine.model.cfg.vocab_size
        self.rounds = {}  # slot -> rounds drafted since its prefill

    def extend(self, segments, next_tokens, aux, rows, finals):
        for s in segments:
            if s.start == 0:
                self.rounds[s.slot] = 0

    def request_row_tensors(self) -> list:
        return []  # its draft depends on the request's tokens only

    @staticmethod
    def _correct_depth(mode: str, rounds: int) -> int:
        """How many leading proposals are correct this round."""
        if mode == "cycle":
            mode = ("full", "partial:1", "zero")[rounds % 3]
        if mode in ("full", "sibling"):
            return 1 << 30
        if mode == "zero":
            return 0
        if mode.startswith("partial:"):
            return int(mode.split(":", 1)[1])
        raise ValueError(f"replay drafter: unknown mode {mode!r} (full, zero, partial:K, sibling, cycle)")

    def _continuation(self, seq, n):
        """(the next n reference tokens, the sequence's mode); ([], "zero") if none matches."""
        for ref, mode in zip(self.sequences, self.modes):
            if len(ref) > len(seq) and ref[: len(seq)] == seq:
                return ref[len(seq) : len(seq) + n], mode
        return [], "zero"

    def draft(self, slots, starts, bonus, histories=None, sampling=None):
        w, V = self.w, self.vocab
        if histories is None:
            raise ValueError("the replay drafter needs each request's token history")
        trees, confs = [], []
        for slot, seq, b in zip(slots, histories, bonus):
            truth, mode = self._continuation(list(seq), w.num_steps)
            ok = self._correct_depth(mode, self.rounds.get(slot, 0))
            self.rounds[slot] = self.rounds.get(slot, 0) + 1
            spine = [t if d < ok else (t + 1) % V for d, t in enumerate(truth)]
            spine += [(seq[-1] + 7 + d) % V for d in range(w.num_steps - len(spine))]
            bld = TreeBuilder(b, w.topk)
            sibling = mode == "sibling"
            leaves = bld.step(self._probs(spine[0], sibling))
            on_spine = next(c for c in leaves if bld.tokens_of(c) == spine[:1])
            for d in range(1, w.num_steps):
                leaves = bld.step(
                    torch.cat([self._probs(spine[d] if c == on_spine else None, sibling) for c in leaves])
                )
                # the spine leaf's child with the next spine token continues the spine
                on_spine = next((c for c in leaves if bld.tokens_of(c) == spine[: d + 1]), None)
            trees.append(bld.finish(w.num_draft_tokens)[0])
            confs.append([0.9 if k < ok else 0.2 for k in range(w.num_steps)])
        if hasattr(w, "gamma"):  # DSpark: synthetic confidences, high where the replay is right
            return Drafts(trees, None, torch.tensor(confs, dtype=torch.float32))
        return trees

    def _probs(self, t, sibling=False):
        """Synthetic draft scores [1, V] (not normalized: the builder only ranks them). The spine
        token `t` gets 0.5 (0.4 in sibling mode, where the wrong token t+1 gets 0.5), distractors
        small shares; off the spine (t None) every score is small, so the spine's descendants
        always rank first and the tree keeps it."""
        V, K = self.vocab, self.w.topk
        p = torch.zeros(1, V)
        if t is None:
            for j in range(K):
                p[0, (j * 13 + 5) % V] = 0.01
            return p
        if sibling and K > 1:
            p[0, t], p[0, (t + 1) % V] = 0.4, 0.5
        else:
            p[0, t] = 0.5
        for j in range(2, K + 1):
            p[0, (t + j) % V] = max(p[0, (t + j) % V].item(), 0.1 / K)
        return p
