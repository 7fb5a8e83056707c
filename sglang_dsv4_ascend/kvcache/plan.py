"""ForwardPlan: the geometry of one batched DeepSeek-V4 forward, built once on the host from the
segments (CPU data only: SGLang's CPU-side batch fields) and shared by every layer, so the layers
themselves run a fixed number of batched tensor ops whatever the mix of prefill chunks, decode
rows and verify rows, and never read a device value back.

Rows. The forward's T query rows are the segments' new tokens concatenated; row t belongs to
segment s (request slot, start L = committed length, n new tokens), sits at position p and is row
first(s) + (p - L) of this forward.

SWA keys (every layer). Query t attends to positions q = p - W + 1 .. p (W = sliding_window), in
that order. q < L is a committed row of the layer's ring (row slot * R + q % R of its kv store,
R = W + spec_slack); q >= L is this forward's own new row first(s) + q - L. Both are contiguous
ranges of the W offsets, given as [lo, hi) per row.

Compressed entries of ratio r (entry j pools positions [j r, (j + 1) r); a query sees j < (p+1)//r):
* committed, j < L // r: row token_slots[slot, j r] // r of the layer's entry store (addressed
  through a strided view of token_slots, never copied per step);
* completed by this forward, L // r <= j < (L + n) // r: pooled now from the compressor rows of
  its window (positions j r - r .. j r + r - 1 with overlap (CSA), j r .. j r + r - 1 without (HCA)),
  each taken from the committed compressor ring (position < L) or from this forward's new rows.
  They are numbered 0..E-1 in segment order; queries list them per segment.

Trees (node-once verify, `Segment.parents`): a tree segment's rows are its nodes, node v at
position L + depth(v). Its window offsets at or after L name v's ancestor at that depth (never a
sibling's branch); an entry is completed by each node at a block's last position, pooled from that
node's ancestors, and a row's mask shows it only the entries its own ancestors (or itself)
completed. Each node is computed once, where path-by-path verify recomputes shared prefixes.
A NextN draft step extends its tree incrementally: the nodes earlier steps computed are the
segment's `past`, keyed from `plan.past_kv` (after the forward's own T rows in the window's pool),
and only the new frontier is computed (SWA-only layers: the draft has no compressor).

Writes (after the layer's reads, or deferred): new SWA and compressor rows go to ring row
slot * R + p % R, keeping only the last R rows of a long segment (older ones would be overwritten
anyway, and two rows of one index_put must never collide); new entries go to their committed row.
The lists are computed here, on the host, for every accepted-prefix variant a speculative caller
asks for, so that no layer needs a data-dependent shape.

Static shapes (`Bucket`). For graph capture a decode or verify forward is padded to a bucket: T
rows, at most `seg_tokens` per request, no request with more than `context` committed tokens.
Every tensor of the plan then has a shape fixed by the bucket and the cache alone (committed-entry
widths at `context` (the cache's capacity when None), new entries padded to T, write lists padded
to T rows), so the layers issue the same ops on the same shapes every step. Padding rows see no
key (their output is 0 and is discarded), and write to the cache's scratch slot and scratch entry
rows, which no request reads.

Why a bucket bounds the context: the reference ops score and gather every column of a committed
table, valid or not, so a plan as wide as the cache costs what the longest possible request costs
on every step. With the committed tables at the cache's 32,768 tokens, a captured verify of 4
blocks of the shipped model took 382 ms against 95 ms eager, and 113 ms with a 512-token cache
(`bench step --graph`, dynamo's trace); at DeepSeek-V4's 1M context every row would score 256K
C4 entries. Requests past the bound run eager (`fits`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Bucket:
    rows: int  # T of the padded forward
    seg_tokens: int  # most tokens one request has in it (1 for decode, the verify width)
    context: int | None = None  # most committed tokens one request has (None: the cache's capacity)


def graph_context(cache, bound: int) -> int | None:
    """The `Bucket.context` a captured forward on `cache` uses for a bound of `bound` committed
    tokens (SGLANG_DSV4_GRAPH_CONTEXT): None (the whole cache) where the bound reaches the cache's
    capacity or the cache has no compressed entries (its width is the window's alone)."""
    if bound >= cache.capacity or not any(cache_ratios(cache)):
        return None
    return int(bound)


def fits(committed, context: int | None) -> bool:
    """Whether every request's committed length (`committed`: an iterable of them, a segment's
    `start`) is within a bucket's `context`."""
    return context is None or max(committed, default=0) <= context


@dataclass
class RatioPlan:
    ratio: int
    overlap: bool
    rows_ring: int  # compressor ring size Rc (per slot)
    n_new: int  # E: entries completed by this forward
    max_committed: int  # max over segments of L // r
    max_new: int  # max over segments of entries completed by this forward
    ent_j: torch.Tensor  # [E] entry number
    ent_row: torch.Tensor  # [E] row of the entry in the layer's entry store (offset-free)
    blk_ring: torch.Tensor  # [E, Lb] ring row of each block position (flattened [S * Rc])
    blk_fresh: torch.Tensor  # [E, Lb] this forward's row of each block position
    blk_from_ring: torch.Tensor  # [E, Lb] bool: the position is committed (< L)
    blk_ok: torch.Tensor  # [E, Lb] bool: False for the missing previous block of entry 0
    slot_entries: torch.Tensor  # [S, ctx // r] strided view of token_slots: entry j of a slot at column j
    com_hi: torch.Tensor  # [T] committed entries visible to the row: L // r
    new_table: torch.Tensor  # [G, max_new] new-entry numbers of each segment
    new_hi: torch.Tensor  # [T] new entries visible to the row: (p + 1) // r - L // r
    new_mask: torch.Tensor | None = None  # [T, max_new] bool, trees only: the entry's node is an ancestor
    # host copies for the writes
    ent_seg_cpu: torch.Tensor = field(repr=False, default=None)
    ent_j_cpu: torch.Tensor = field(repr=False, default=None)
    ent_done_cpu: torch.Tensor = field(repr=False, default=None)  # [E] the row (node) completing the entry


@dataclass
class ForwardPlan:
    segments: list
    T: int
    window: int
    ring: int  # R
    row_slot: torch.Tensor  # [T]
    row_pos: torch.Tensor  # [T]
    row_seg: torch.Tensor  # [T]
    row_start: torch.Tensor  # [T] L of the row's segment
    swa_com: torch.Tensor  # [T, W] ring rows (flattened [S * R])
    swa_com_lo: torch.Tensor  # [T]
    swa_com_hi: torch.Tensor  # [T]
    swa_fresh: torch.Tensor  # [T, W] rows of this forward
    swa_fresh_lo: torch.Tensor  # [T]
    swa_fresh_hi: torch.Tensor  # [T]
    ratios: dict  # ratio -> RatioPlan
    device: object = None
    bucket: Bucket | None = None
    n_real: int = 0  # rows that belong to segments (the rest is bucket padding)
    host_groups: tuple | None = None  # (row_slot, row_seg) as Python lists, for host-side decisions in layers
    past_kv: dict | None = None  # layer -> [P, D] keys of tree nodes computed earlier (Segment.past), set by the caller
    # host copies (CPU tensors) used to build write lists
    cpu: dict = field(repr=False, default_factory=dict)
    _writes: dict = field(repr=False, default_factory=dict)

    def zeros(self) -> torch.Tensor:
        if "zeros" not in self._writes:
            self._writes["zeros"] = torch.zeros(self.T, dtype=torch.long, device=self.device)
        return self._writes["zeros"]

    def writes(self, accepted: dict | None = None, keep: tuple | None = None) -> "WriteLists":
        """Index lists for storing this forward's rows and entries; `accepted[slot] = n` keeps only
        that segment's first n tokens (and the entries they complete); `keep[i] = n` does it by
        segment index for every segment (several segments may share a slot: tree verify paths).
        Cached per variant."""
        if keep is not None:
            if len(keep) != len(self.segments):
                raise ValueError(f"keep has {len(keep)} lengths for {len(self.segments)} segments")
            n = tuple(_stored(k, s) for k, s in zip(keep, self.segments))
        elif accepted:
            n = tuple(_stored(accepted[s.slot], s) if s.slot in accepted else s.length for s in self.segments)
        else:
            n = None  # store whole (a static plan's padding included)
        if n not in self._writes:
            self._writes[n] = _write_lists(self, n)
        return self._writes[n]


@dataclass
class WriteLists:
    swa_src: torch.Tensor  # rows of this forward to store
    swa_dst: torch.Tensor  # their ring rows (flattened [S * R])
    rows: dict  # ratio -> (src rows, dst ring rows (flattened [S * Rc]))
    entries: dict  # ratio -> (new-entry numbers to store, their rows in the entry store)
    state_segs: list = field(default_factory=list)  # (slot, start, stored n, first row) per stored segment
    static: bool = False  # a bucket plan's store inside its captured forward: drops states, saves none
    _states: tuple = field(default=None, repr=False)

    def states(self, cache):
        """The prefix states this store completes (prefix_state.py), reserved on the first store
        that uses these lists: a variant that is never stored (the whole-forward lists of a
        verify whose rows get rejected) must not claim states it never writes."""
        # A bucket plan's whole-forward store runs inside the captured forward (a decode) and
        # saves none (same ops every step); the boundaries it completes were forgotten when the
        # plan was built. Tested first: a captured forward must not read the host list below,
        # which changes every step. Its accepted-prefix stores (a captured verify's commit,
        # cache.apply after the forward, eager) save them as an eager plan's do.
        if self.static or cache.prefix is None or not self.state_segs:
            return None
        if self._states is None:
            self._states = (cache.state_lists(self.state_segs, device=self.swa_src.device),)
        return self._states[0]


def _stored(n, seg):
    """Tokens of `seg` to store: n, within [0, length]; for a tree segment its accepted path (node
    indices from the root, each the parent of the next), or 0 for nothing."""
    if seg.parents is None:
        return max(0, min(int(n), seg.length))
    if isinstance(n, int) and n == 0:
        return ()
    path = tuple(int(v) for v in n)
    if not path or path[0] != 0 or any(seg.parents[b] != a for a, b in zip(path, path[1:])):
        raise ValueError(f"tree segment {seg}: keep must be an accepted root-to-node path, got {n}")
    return path


def _count(k) -> int:
    return len(k) if isinstance(k, tuple) else int(k)


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def build_plan(segments, cache, device=None, bucket: Bucket | None = None) -> ForwardPlan:
    """The plan of one forward over `segments` (host objects) against `cache`; with a `bucket`,
    padded to its static shapes."""
    device = cache.device if device is None else device
    W, R = cache.cfg.sliding_window, cache.window_ring
    G = len(segments)
    seg_slot = torch.tensor([s.slot for s in segments], dtype=torch.long)
    seg_L = torch.tensor([s.start for s in segments], dtype=torch.long)
    seg_n = torch.tensor([s.length for s in segments], dtype=torch.long)
    seg_first = _excl_cumsum(seg_n)
    T = int(seg_n.sum())
    if bucket is not None:
        _check_bucket(bucket, segments, T, cache)
    Tp = T if bucket is None else bucket.rows
    P = Tp - T  # padding rows: slot 0 for reads (nothing visible), the scratch slot for writes
    row_seg = torch.repeat_interleave(torch.arange(G), seg_n)
    row_off = torch.arange(T) - seg_first[row_seg]
    row_slot, row_L = seg_slot[row_seg], seg_L[row_seg]
    trees = {i: _Tree(s, int(seg_first[i])) for i, s in enumerate(segments) if s.parents is not None}
    if trees and bucket is not None:
        raise ValueError(f"bucket {bucket}: tree segments (node-once verify) run eager")
    row_depth = row_off.clone()
    for t in trees.values():
        row_depth[t.rows] = t.depth
    row_pos = row_L + row_depth
    row_first = seg_first[row_seg]
    pad = torch.zeros(P, dtype=torch.long)
    row_seg_p = torch.cat([row_seg, torch.full((P,), Tp)])  # a table row no segment uses
    row_slot_p, row_pos_p, row_L_p, row_first_p = (torch.cat([x, pad]) for x in (row_slot, row_pos, row_L, row_first))
    real = torch.arange(Tp) < T

    # SWA window: offset k holds position q = p - (W - 1) + k.
    k = torch.arange(W)
    q = row_pos_p[:, None] - (W - 1) + k
    com_lo = (W - 1 - row_pos_p).clamp(0, W)
    com_hi = torch.where(real, (row_L_p - row_pos_p + W - 1).clamp(0, W), 0)
    swa_com = row_slot_p[:, None] * R + q.clamp(min=0) % R
    swa_fresh = (row_first_p[:, None] + q - row_L_p[:, None]).clamp(min=0)
    for t in trees.values():  # a node's rows at depth d < its own: its ancestor's
        swa_fresh[t.rows] = t.pool_rows(Tp)[t.ancestor_at(q[t.rows] - t.seg.start)]
    fresh_hi = torch.where(real, W, 0)

    def dev(t):
        return t.to(device)

    ratios = {}
    for r in sorted({x for x in cache_ratios(cache) if x}):
        ratios[r] = _ratio_plan(
            r, cache, seg_slot, seg_L, seg_n, seg_first, row_pos_p, row_L_p, real, dev, bucket, trees
        )
    plan = ForwardPlan(
        segments=list(segments),
        T=Tp,
        window=W,
        ring=R,
        row_slot=dev(row_slot_p),
        row_pos=dev(row_pos_p),
        row_seg=dev(row_seg_p),
        row_start=dev(row_L_p),
        swa_com=dev(swa_com),
        swa_com_lo=dev(com_lo),
        swa_com_hi=dev(com_hi),
        swa_fresh=dev(swa_fresh),
        swa_fresh_lo=dev(com_hi),
        swa_fresh_hi=dev(fresh_hi),
        ratios=ratios,
        device=device,
        bucket=bucket,
        n_real=T,
        # Host-side sharing decisions would vary with the batch: a static plan makes none.
        host_groups=None if bucket is not None else (row_slot_p.tolist(), row_seg_p.tolist()),
        cpu=dict(
            seg_slot=seg_slot,
            seg_L=seg_L,
            seg_n=seg_n,
            seg_first=seg_first,
            row_seg=row_seg,
            row_off=row_off,
            row_slot=row_slot,
            row_pos=row_pos,
            pad_slot=cache.pad_slot,
            trees=trees,
        ),
    )
    # The store-everything lists and the zeros, now: host work belongs before the forward, and a
    # captured forward must find the plan as it will always be.
    lists = plan.writes()
    plan.zeros()
    if bucket is not None and cache.prefix is not None and lists.state_segs:
        # host-side only: forget what the pages this step completes held before
        cache.prefix.forget_boundaries(lists.state_segs, cache.key_slots)
    return plan


def _check_bucket(bucket: Bucket, segments, T: int, cache) -> None:
    longest = max((s.length for s in segments), default=0)
    smallest_ring = min([cache.window_ring] + [cache.rows_ring(r) for r in cache_ratios(cache) if r])
    if T > bucket.rows or longest > bucket.seg_tokens:
        raise ValueError(f"bucket {bucket}: the forward has {T} rows and up to {longest} per request")
    reach = max((s.start for s in segments), default=0)
    if not fits([reach], bucket.context):
        raise ValueError(f"bucket {bucket}: a request has {reach} committed tokens, above the bucket's context")
    if bucket.seg_tokens > smallest_ring:
        raise ValueError(
            f"bucket {bucket}: seg_tokens above the smallest ring ({smallest_ring} rows); "
            "static plans are for decode and verify batches"
        )


def cache_ratios(cache):
    return {st.ratio for st in cache.layers}


def _ratio_plan(r, cache, seg_slot, seg_L, seg_n, seg_first, row_pos, row_L, real, dev, bucket, trees) -> RatioPlan:
    overlap = r == 4
    Rc = cache.rows_ring(r)
    j0, j1 = seg_L // r, (seg_L + seg_n) // r
    ne = j1 - j0
    if any(t.past for t in trees.values()):
        raise ValueError("tree segments with past nodes (incremental draft steps) are for SWA-only layers")
    done = {i: t.completing(r) for i, t in trees.items()}  # a tree: one entry per completing node
    for i, nodes in done.items():
        ne[i] = len(nodes)
    E = int(ne.sum())
    ent_seg = torch.repeat_interleave(torch.arange(len(seg_L)), ne)
    first_ent = _excl_cumsum(ne)
    ent_j = j0[ent_seg] + (torch.arange(E) - first_ent[ent_seg])
    ent_done = seg_first[ent_seg] + (ent_j + 1) * r - 1 - seg_L[ent_seg]
    for i, nodes in done.items():
        e = slice(int(first_ent[i]), int(first_ent[i]) + len(nodes))
        ent_j[e] = (trees[i].seg.start + trees[i].depth[nodes] + 1) // r - 1
        ent_done[e] = trees[i].first + nodes
    Lb = 2 * r if overlap else r
    qpos = (ent_j * r - (r if overlap else 0))[:, None] + torch.arange(Lb)
    L_e = seg_L[ent_seg][:, None]
    blk_ok = qpos >= 0
    blk_from_ring = qpos < L_e
    blk_ring = seg_slot[ent_seg][:, None] * Rc + qpos.clamp(min=0) % Rc
    blk_fresh = (seg_first[ent_seg][:, None] + qpos - L_e).clamp(min=0)
    for i, nodes in done.items():  # the block's new positions along the completing node's path
        e = slice(int(first_ent[i]), int(first_ent[i]) + len(nodes))
        t = trees[i]
        blk_fresh[e] = t.first + t.ancestor_at(qpos[e] - t.seg.start, nodes)
    ts = cache.token_slots
    ent_row = ts[dev(seg_slot[ent_seg]), dev(ent_j * r)].long() // r
    if bucket is None:
        max_new = int(ne.max()) if len(ne) else 0
        max_committed = int(j0.max()) if len(j0) else 0
        n_tab, Ep = len(seg_L), E
    else:  # static: widths from the bucket and the cache, E padded to T
        context = cache.capacity if bucket.context is None else bucket.context
        max_new, max_committed = -(-bucket.seg_tokens // r), context // r
        n_tab, Ep = bucket.rows + 1, bucket.rows
    Pe = Ep - E  # padding entries: pooled from nothing, stored in the scratch entry row
    if Pe:
        zl = torch.zeros(Pe, dtype=torch.long)
        ent_j, blk_ok = torch.cat([ent_j, zl]), torch.cat([blk_ok, torch.zeros(Pe, Lb, dtype=torch.bool)])
        blk_from_ring = torch.cat([blk_from_ring, torch.ones(Pe, Lb, dtype=torch.bool)])
        blk_ring = torch.cat([blk_ring, torch.full((Pe, Lb), cache.pad_slot * Rc)])
        blk_fresh = torch.cat([blk_fresh, torch.zeros(Pe, Lb, dtype=torch.long)])
        ent_row = torch.cat([ent_row, dev(torch.full((Pe,), cache.pad_entry_row(r)))])
    new_table = torch.zeros(n_tab, max_new, dtype=torch.long)
    new_table[: len(seg_L)] = (first_ent[:, None] + torch.arange(max_new)).clamp(0, max(E - 1, 0))
    row_j0 = torch.where(real, row_L // r, 0)
    new_hi = torch.where(real, (row_pos + 1) // r - row_L // r, 0)
    new_mask = None
    if done:  # a tree's row sees the entries its ancestors completed, whichever column they sit in
        new_mask = torch.ones(len(row_pos), max_new, dtype=torch.bool)
        for i, nodes in done.items():
            t = trees[i]
            new_hi[t.rows] = len(nodes)
            new_mask[t.rows, : len(nodes)] = t.is_ancestor[:, nodes]
    return RatioPlan(
        ratio=r,
        overlap=overlap,
        rows_ring=Rc,
        n_new=Ep,
        max_committed=max_committed,
        max_new=max_new,
        ent_j=dev(ent_j),
        ent_row=ent_row,
        blk_ring=dev(blk_ring),
        blk_fresh=dev(blk_fresh),
        blk_from_ring=dev(blk_from_ring),
        blk_ok=dev(blk_ok),
        slot_entries=ts[:, ::r] if bucket is None or bucket.context is None else ts[:, ::r][:, :max_committed],
        com_hi=dev(row_j0),
        new_table=dev(new_table),
        new_hi=dev(new_hi),
        new_mask=None if new_mask is None else dev(new_mask),
        ent_seg_cpu=ent_seg,
        ent_j_cpu=ent_j[:E],
        ent_done_cpu=ent_done,
    )


class _Tree:
    """A tree segment's host geometry: new node v (after the segment's past ones) is row
    first + v, at position start + depth[v]."""

    def __init__(self, seg, first: int):
        self.seg, self.first, self.past = seg, first, len(seg.past)
        n = len(seg.parents)
        self.rows = slice(first, first + seg.length)
        self.depth = torch.tensor(seg.depths(), dtype=torch.long)
        D = max(seg.node_depths()) + 1
        anc = torch.zeros(n, D, dtype=torch.long)  # anc[v, d]: v's ancestor at depth d (d <= depth v)
        self.is_ancestor = torch.zeros(n, n, dtype=torch.bool)  # [v, u]: u is v or above it
        for v in range(n):
            path = seg.ancestors(v)
            anc[v, : len(path)] = torch.tensor(path)
            anc[v, len(path) :] = v
            self.is_ancestor[v, path] = True
        self.anc = anc

    def ancestor_at(self, d: torch.Tensor, nodes: torch.Tensor | None = None) -> torch.Tensor:
        """Node indices of each new node's (or `nodes`') ancestor at depths `d` [n or len(nodes),
        K] (clamped into the node's own path; offsets outside it are masked by the caller)."""
        anc = self.anc[self.past :] if nodes is None else self.anc[nodes]
        return anc.gather(1, d.clamp(0, anc.shape[1] - 1))

    def pool_rows(self, T: int) -> torch.Tensor:
        """Each node's key row in the forward's fresh SWA pool: a new node's own row, a past
        node's row T + past[v] (plan.past_kv follows the forward's T rows)."""
        new = self.first + torch.arange(self.seg.length)
        return torch.cat([T + torch.tensor(self.seg.past, dtype=torch.long), new])

    def completing(self, r: int) -> torch.Tensor:
        """The nodes at a block's last position (each completes an entry of ratio r)."""
        return torch.nonzero((self.seg.start + self.depth + 1) % r == 0).flatten()


def _write_lists(plan: ForwardPlan, lengths: tuple | None) -> WriteLists:
    """`lengths`: tokens stored per segment (None: all of them, and the bucket's padding)."""
    c = plan.cpu
    accepted = lengths is not None
    n = c["seg_n"].clone() if lengths is None else torch.tensor([_count(k) for k in lengths], dtype=torch.long)
    rows_of = {}  # tree segment -> the rows of its stored path, by offset from its start
    for i, t in c["trees"].items():
        path = lengths[i] if accepted else ()  # a tree is never stored whole: siblings share positions
        rows_of[i], n[i] = tuple(t.first + v for v in path), len(path)
    end = c["seg_L"] + n  # committed length after this forward
    row_end = end[c["row_seg"]]
    stored = c["row_off"] < n[c["row_seg"]]
    for i, t in c["trees"].items():
        stored[t.rows] = False
        stored[list(rows_of[i])] = True
    # A static plan stores whole (accepted is None): its padding rows and entries go to the scratch
    # slot and entry rows, so every list has the bucket's length.
    pad_rows = plan.T - plan.n_real if not accepted else 0

    def ring_list(ring):
        keep = stored & (c["row_pos"] >= row_end - ring)  # the last `ring` stored rows of each segment
        src = torch.nonzero(keep).flatten()
        dst = c["row_slot"][src] * ring + c["row_pos"][src] % ring
        if pad_rows:
            src = torch.cat([src, torch.arange(plan.n_real, plan.T)])
            dst = torch.cat([dst, torch.full((pad_rows,), c["pad_slot"] * ring)])
        return src.to(plan.device), dst.to(plan.device)

    swa_src, swa_dst = ring_list(plan.ring)
    rows, entries = {}, {}
    for r, rp in plan.ratios.items():
        rows[r] = ring_list(rp.rows_ring)
        E = len(rp.ent_j_cpu)
        keep = stored[rp.ent_done_cpu] if E else torch.zeros(0, dtype=torch.bool)  # its last row is stored
        if not accepted:
            keep = torch.cat([keep, torch.ones(rp.n_new - E, dtype=torch.bool)])
        idx = torch.nonzero(keep).flatten().to(plan.device)
        entries[r] = (idx, rp.ent_row[idx])
    state_segs = [
        (int(sl), int(L), int(k), rows_of.get(i, int(f)))
        for i, (sl, L, k, f) in enumerate(zip(c["seg_slot"], c["seg_L"], n, c["seg_first"]))
        if k > 0
    ]
    return WriteLists(swa_src, swa_dst, rows, entries, state_segs, static=plan.bucket is not None and not accepted)


class PlanBuffers:
    """One persistent plan per bucket, for graph capture: a captured forward reads its plan's
    tensors at the addresses it saw when captured (a device graph replays those addresses; a
    compiled function is traced against those objects), so each step's plan is built on the host
    as usual and then copied into the bucket's buffers, and the forward gets the same plan object
    with the same tensors every time. Everything a forward reads is refreshed in place; host-side
    fields (segments, write bookkeeping) are rebound. Allocated for a bucket the first time it
    is loaded (at capture)."""

    def __init__(self, cache):
        self.cache = cache
        self.plans: dict = {}  # Bucket -> ForwardPlan whose tensors are the static buffers

    def load(self, segments, bucket: Bucket, device=None) -> ForwardPlan:
        fresh = build_plan(segments, self.cache, device=device, bucket=bucket)
        static = self.plans.get(bucket)
        if static is None:
            self.plans[bucket] = fresh
            return fresh
        _refresh(static, fresh)
        return static


# the tensors of a ForwardPlan and of a RatioPlan that a forward reads
_ROW_TABLES = (
    *("row_slot", "row_pos", "row_seg", "row_start"),
    *("swa_com", "swa_com_lo", "swa_com_hi", "swa_fresh", "swa_fresh_lo", "swa_fresh_hi"),
)
_ENTRY_TABLES = (
    *("ent_j", "ent_row", "blk_ring", "blk_fresh", "blk_from_ring", "blk_ok"),
    *("com_hi", "new_table", "new_hi"),
)


def _refresh(static, fresh) -> None:
    """Copy `fresh` (a plan of the same bucket) into `static` field by field: tensors in place
    (same shapes by construction of the bucket), host values rebound."""
    if isinstance(static, ForwardPlan):
        static.segments, static.n_real, static.cpu = fresh.segments, fresh.n_real, fresh.cpu
        for name in _ROW_TABLES:
            _copy(getattr(static, name), getattr(fresh, name), name)
        for r, rp in static.ratios.items():
            _refresh(rp, fresh.ratios[r])
        s, f = static.writes(), fresh.writes()
        _copy(s.swa_src, f.swa_src, "swa_src")
        _copy(s.swa_dst, f.swa_dst, "swa_dst")
        for r in s.rows:
            for a, b in zip(s.rows[r] + s.entries[r], f.rows[r] + f.entries[r]):
                _copy(a, b, f"writes[{r}]")
        s.state_segs = f.state_segs
        # The accepted-prefix variants (a verify's `cache.apply(keep=...)`, after the forward)
        # were computed from an earlier step's rows: this step computes its own.
        for key in [k for k in static._writes if k not in (None, "zeros")]:
            del static._writes[key]
        return
    # RatioPlan: slot_entries is a view of the token slots, the same storage every step
    static.ent_seg_cpu, static.ent_j_cpu, static.ent_done_cpu = fresh.ent_seg_cpu, fresh.ent_j_cpu, fresh.ent_done_cpu
    for name in _ENTRY_TABLES:
        _copy(getattr(static, name), getattr(fresh, name), name)


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise RuntimeError(f"PlanBuffers: {name} has shape {tuple(src.shape)}, its buffer {tuple(dst.shape)}")
    dst.copy_(src)
