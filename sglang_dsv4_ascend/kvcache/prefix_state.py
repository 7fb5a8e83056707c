"""Prefix states: what a radix-cache hit needs besides the compressed entries.

A request that reuses a cached prefix of length L (a multiple of the page, 128 tokens) must see
exactly what it would have seen had it computed the prefix itself:

* every compressed entry j < L // r (C4 KV, C4 indexer keys, C128 KV). These are already paged
  through token slots (`cache.py`): the tree's slots of the prefix carry them, nothing to do;
* the SWA rows of positions L - W .. L - 1 (W = sliding_window);
* the compressor rows of the blocks still open at L. L is a multiple of 128, so every C4 and
  C128 block ends there; only the overlapping C4 compressor (and the C4 indexer's compressor)
  reads the previous block, positions L - 4 .. L - 1, when it pools entry L // 4.

That last pair is small and fixed-size: a *state* at boundary L. This store keeps such states,
one per page boundary that a forward completed, keyed by the token slot of position L - 1
(`req_to_token[req, L - 1]`: unique while the page is in the tree, and a slot always sits at
the same offset of its page, so a reused slot is overwritten when its new page completes before
that page can be in the tree again). A hit is usable only up to the deepest boundary with a
state (`DSV4RadixCache.match_prefix` truncates there); when the request's slot is first used
the backend copies the state into the slot's rings (`DSV4Cache.restore_prefix`).

States are written in the same store step as the rings (`LayerWrites.store` / `DSV4Cache.write`),
from this forward's new rows or the ring, before the ring is overwritten, so a boundary deep
inside an 8K prefill chunk (a shared system prompt) gets its state without extra work beyond one
copy of the window. Speculative verify stores only accepted rows, so a boundary gets a state
only once it is committed. A speculative worker's draft state rides along under the same index:
the NextN layer's window (its cache's store is `link`ed to this one) and DSpark's per-stage
context rows (`extras["dspark_ctx"]`), both saved in the step that commits the boundary and
restored with the target (`speculative/drafters.py`). NextN row p reads token p + 1; SGLang's
tree keys EAGLE prefixes by token pairs, so a hit at L shares token L too.

Memory. A state is W rows per layer in the cache dtype plus, per CSA layer, OVERLAP_ROWS fp32
rows of (kv, gate) for its compressor (width 2 x head_dim) and its indexer's (2 x index_head_dim).
For the released configs (bf16, W = 128, head_dim 512, index_head_dim 128):
  V4-Flash (43 layers, 21 CSA): 43*128*512*2 + 21*4*(2*1024 + 2*256)*4 = 6.50 MB per state
  V4-Pro   (61 layers, 30 CSA): 61*128*512*2 + 30*4*(2*1024 + 2*256)*4 = 9.22 MB per state
against 0.88 / 1.26 MB of compressed entries per 128-token page (6880 / 9848 bytes per token,
`bench cache`), so a state at every page would cost about 7.4x the entries: SGLang's own
DeepSeek-V4 tree faces the same (it keeps SWA KV per token and tombstones it outside a budget).
The store is a fixed LRU of `capacity` states (default: one per 16 pages of the token pool,
`SGLANG_DSV4_PREFIX_STATES`), so a cached token costs its entries plus 6.50 MB / (16 * 128) =
3.2 KB (Flash; +0.46x the entries; Pro 4.5 KB, +0.46x), and a 128K request with a 90 % hit needs
one state (the boundary of its hit) to skip 115K tokens of prefill. Per request at 128K (`bench
prefix`, bf16): without the prefix cache Flash holds 937.5 MB (`bench cache`: entries + rings) and
recomputes all of it; with a 90 % hit it reuses 811.6 MB of shared entries plus one 6.5 MB state
and computes the remaining 10 % (Pro: 1344.3 MB; 1161.8 + 9.2 MB reused). Every hit refreshes the LRU
order, so reused boundaries (system prompts, earlier turns) stay while one-off interior
boundaries of long prompts age out.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from .. import settings

OVERLAP_ROWS = 4  # the C4 block before the boundary, read by the overlapping compressors


class PrefixStates:
    def __init__(self, cache, capacity: int, page: int, link: "PrefixStates | None" = None):
        """`link`: the target's store, for a draft cache's store (the NextN layer's window): it
        keeps its own rows but uses the target's keys and indices, so a state covers target and
        draft together, and saving a draft row never evicts anything."""
        if capacity <= 0:
            raise ValueError(
                f"{settings.PREFIX_STATES.name}={capacity}: the prefix state store needs at least one state"
            )
        self.capacity, self.page, self.link = capacity, page, link
        self.window = cache.cfg.sliding_window
        dev = cache.device
        self.swa, self.rows = [], []
        for st in cache.layers:
            self.swa.append(torch.zeros(capacity, self.window, st.swa.shape[-1], dtype=cache.dtype, device=dev))
            rows = {}
            if st.ratio == 4:
                for name, (kv, _) in st.rows.items():
                    shape = (capacity, OVERLAP_ROWS, kv.shape[-1])
                    rows[name] = (
                        torch.zeros(shape, dtype=kv.dtype, device=dev),
                        torch.zeros(shape, dtype=kv.dtype, device=dev),
                    )
            self.rows.append(rows)
        self.extras: dict = {}  # name -> [capacity, ...]: draft state kept beside (drafters.py)
        self._by_key: dict[int, int] = {}  # token slot of position L - 1 -> state index
        self._key = [-1] * capacity
        self._boundary = [0] * capacity
        # Segmented LRU: new states enter `_lru` (probation); a state that served a hit, or that
        # a miss asked for (a branching point, `hint`), moves to `_kept` (at most half the store).
        # Eviction takes probation first, so one long prompt's interior boundaries cannot push
        # out the boundaries that requests actually share.
        self._lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self._kept: OrderedDict[int, None] = OrderedDict()
        self.hints: OrderedDict = OrderedDict()  # request id -> branching boundary it should save
        self.wanted: set = set()  # (slot, boundary) of this forward to keep (from the hints)
        self._free = list(range(capacity - 1, -1, -1))
        self.hits = self.writes = 0

    @staticmethod
    def default_capacity(num_token_slots: int, page: int) -> int:
        return settings.PREFIX_STATES.get(default=max(16, num_token_slots // page // 16))

    def lookup(self, key: int, boundary: int) -> int | None:
        """The state saved at `boundary` by the token slot `key` of position boundary - 1."""
        if self.link is not None:
            return self.link.lookup(key, boundary)
        idx = self._by_key.get(int(key))
        if idx is None or self._boundary[idx] != boundary:
            return None
        return idx

    def touch(self, idx: int) -> None:
        self.keep(idx)
        self.hits += 1

    def keep(self, idx: int) -> None:
        self._lru.pop(idx, None)
        self._kept[idx] = None
        self._kept.move_to_end(idx)
        if len(self._kept) > max(1, self.capacity // 2):  # the oldest kept one goes back on probation
            old, _ = self._kept.popitem(last=False)
            self._lru[old] = None

    def hint(self, request_id, boundary: int) -> None:
        """A match found the tree's tokens up to `boundary` but no state there (a branching point,
        e.g. the end of a shared system prompt inside an earlier, longer prompt): the request's own
        prefill will pass it, and the state it saves there is kept (SGLang's Mamba tree does the
        same with its branching seqlen)."""
        self.hints[request_id] = boundary
        self.hints.move_to_end(request_id)
        while len(self.hints) > 4096:  # requests that never ran
            self.hints.popitem(last=False)

    def rekey(self, old: int, new: int, boundary: int) -> None:
        """The state saved at `boundary` under token slot `old` now belongs to slot `new` (the tree
        kept its own copy of that page and freed `old`), unless `new` has a state there already."""
        idx = self.lookup(old, boundary)
        if idx is None or self.lookup(new, boundary) is not None:
            return
        stale = self._by_key.pop(int(new), None)  # `new` saved at another boundary: not its page now
        if stale is not None:
            self._lru.pop(stale, None)
            self._kept.pop(stale, None)
            self._key[stale] = -1
            self._free.append(stale)
        del self._by_key[int(old)]
        self._by_key[int(new)] = idx
        self._key[idx] = int(new)

    def _evict_one(self) -> int:
        src = self._lru if self._lru else self._kept
        idx, _ = src.popitem(last=False)
        del self._by_key[self._key[idx]]
        return idx

    def usable_prefix(self, slots: list, length: int) -> int:
        """Deepest page boundary <= length whose state is here, for a prefix whose token slot of
        position p is slots[p]; that state is marked recently used."""
        for b in range(length - length % self.page, 0, -self.page):
            idx = self.lookup(slots[b - 1], b)
            if idx is not None:
                self.touch(idx)
                return b
        return 0

    def reserve(self, keys: list, boundaries: list) -> list:
        """State indices for the boundaries a store step is about to write (the oldest state is
        reused when full). Returns one index per boundary, or -1 for a boundary whose index a
        later one of the same call took (more boundaries than capacity: the deepest win). A linked
        store only finds the indices its target reserved in the same step (-1 where none)."""
        if self.link is not None:
            return [-1 if (i := self.link.lookup(k, b)) is None else i for k, b in zip(keys, boundaries)]
        out = []
        for key, b in zip(keys, boundaries):
            key = int(key)
            idx = self._by_key.get(key)
            if idx is None:
                if self._free:
                    idx = self._free.pop()
                else:
                    idx = self._evict_one()
                    out = [-1 if i == idx else i for i in out]
                self._by_key[key] = idx
                self._key[idx] = key
            self._boundary[idx] = b
            self._kept.pop(idx, None)  # new content: on probation
            self._lru[idx] = None
            self._lru.move_to_end(idx)
            out.append(idx)
        self.writes += len(keys)
        return out

    def forget_boundaries(self, segs: list, token_slots) -> None:
        """Drop the states of the page boundaries `segs` complete without saving new ones (a
        static plan): whatever those slots held before belongs to an earlier request."""
        if self.link is not None:
            return self.link.forget_boundaries(segs, token_slots)
        for slot, start, n, _ in segs:
            for b in range((start // self.page + 1) * self.page, start + n + 1, self.page):
                idx = self._by_key.pop(int(token_slots[slot, b - 1]), None)
                if idx is not None:
                    self._lru.pop(idx, None)
                    self._kept.pop(idx, None)
                    self._key[idx] = -1
                    self._free.append(idx)

    def nbytes(self) -> int:
        n = sum(t.numel() * t.element_size() for t in self.swa)
        n += sum(t.numel() * t.element_size() for t in self.extras.values())
        for rows in self.rows:
            n += sum(kv.numel() * kv.element_size() * 2 for kv, _ in rows.values())
        return n

    def stats(self) -> dict:
        return {
            "capacity": self.capacity,
            "used": len(self._lru) + len(self._kept),
            "kept": len(self._kept),
            "hits": self.hits,
            "writes": self.writes,
            "bytes": self.nbytes(),
        }


class StateLists:
    """Where one store step finds the rows of each state it saves: per state, the W window
    positions and the OVERLAP_ROWS compressor positions before its boundary, each taken from this
    forward's new rows (`*_new`, rows of the step's tensors) or from the slot's ring (`*_ring`,
    flat ring rows) when the position was committed before the step."""

    def __init__(self, idx, swa_new, swa_ring, swa_take_new, swa_valid, row_new, row_ring, row_take_new):
        self.idx, self.swa_new, self.swa_ring = idx, swa_new, swa_ring
        self.swa_take_new, self.swa_valid = swa_take_new, swa_valid
        self.row_new, self.row_ring, self.row_take_new = row_new, row_ring, row_take_new


def boundaries_of(store: PrefixStates, segs) -> list:
    """(slot, start, first row, boundary b) for each page boundary L < b <= L + n of `segs`
    (slot, start L, stored n, first row)."""
    page = store.page
    return [
        (slot, start, first, b)
        for slot, start, n, first in segs
        for b in range((start // page + 1) * page, start + n + 1, page)
    ]


def state_lists(
    store: PrefixStates, segs: list, swa_ring: int, rows_ring: int | None, token_slots, device
) -> StateLists | None:
    """Reserve states for the page boundaries that `segs` complete and return their gather lists.
    `segs`: (slot, start L, stored tokens n, first row of the segment in the step's new rows, or
    the rows of a tree segment's stored path).
    A boundary b with L < b <= L + n is complete once the step stores its rows."""
    W = store.window
    found = boundaries_of(store, segs)
    if not found:
        return None
    if store.link is None:
        # The wanted ones (hinted branching points) are saved; of the others, only as many as
        # probation holds (a long prompt's boundaries never push out kept states), the deepest
        # first. The rest are forgotten (their slots' old states belong to earlier requests).
        # Wanted ones are reserved last, so that nothing of this step evicts them.
        wanted = [f for f in found if (f[0], f[3]) in store.wanted][-store.capacity :]
        others = [f for f in found if (f[0], f[3]) not in store.wanted]
        room = max(0, store.capacity - len(store._kept) - len(wanted))
        drop = others[: max(0, len(others) - room)]
        if drop:
            store.forget_boundaries([(f[0], f[3] - 1, 1, 0) for f in drop], token_slots)
        found = others[len(drop) :] + wanted
        if not found:
            return None
    slots = torch.tensor([f[0] for f in found], device=token_slots.device)
    ends = torch.tensor([f[3] - 1 for f in found], device=token_slots.device)
    keys = token_slots[slots, ends].tolist()
    idx = store.reserve(keys, [f[3] for f in found])
    kept = [(f, i) for f, i in zip(found, idx) if i >= 0]
    if store.link is None:
        for f, i in kept:
            if (f[0], f[3]) in store.wanted:
                store.keep(i)
    slot = torch.tensor([f[0] for f, _ in kept])[:, None]
    start = torch.tensor([f[1] for f, _ in kept])[:, None]
    # f[2]: the segment's first row in the step (its rows follow in order), or for a tree
    # segment (node-once verify) the rows of its stored path
    trees = [(k, f[2]) for k, (f, _) in enumerate(kept) if isinstance(f[2], tuple)]
    first = torch.tensor([0 if isinstance(f[2], tuple) else f[2] for f, _ in kept])[:, None]
    b = torch.tensor([f[3] for f, _ in kept])[:, None]

    def lists(q, ring):
        take_new = q >= start
        new = (first + q - start).clamp(min=0)
        for k, rows in trees:  # a tree's stored path: its rows by offset from the start
            new[k] = torch.tensor(rows)[(q[k] - start[k]).clamp(0, len(rows) - 1)]
        ring_rows = slot * ring + q.clamp(min=0) % ring if ring else torch.zeros_like(q)
        return new.to(device), ring_rows.to(device), take_new.to(device)

    q = b - W + torch.arange(W)
    swa_new, swa_ring_rows, swa_take = lists(q, swa_ring)
    q4 = b - OVERLAP_ROWS + torch.arange(OVERLAP_ROWS)
    row_new, row_ring_rows, row_take = lists(q4, rows_ring)
    return StateLists(
        torch.tensor([i for _, i in kept], device=device),
        swa_new,
        swa_ring_rows,
        swa_take,
        (q >= 0).to(device),
        row_new,
        row_ring_rows,
        row_take,
    )


def save_states(store: PrefixStates, layer: int, sl: StateLists, st, swa_new, rows_new: dict) -> None:
    """Copy one layer's state rows, before the step overwrites the ring: window rows from the
    layer's ring (`st.kv`'s first rows) or `swa_new`, C4 compressor rows likewise."""
    ring_rows = st.kv[sl.swa_ring]
    rows = torch.where(sl.swa_take_new[..., None], swa_new[sl.swa_new].to(ring_rows.dtype), ring_rows)
    store.swa[layer][sl.idx] = torch.where(sl.swa_valid[..., None], rows, 0).to(store.swa[layer].dtype)
    for name, dsts in store.rows[layer].items():
        for dst, ring, new in zip(dsts, st.rows[name], rows_new[name]):
            old = ring.view(-1, ring.shape[-1])[sl.row_ring]
            dst[sl.idx] = torch.where(sl.row_take_new[..., None], new[sl.row_new].to(old.dtype), old)


def restore_state(store: PrefixStates, cache, slot: int, boundary: int) -> None:
    """Put the state saved at `boundary` for this slot's prefix into the slot's rings."""
    key = int(cache.key_slots[slot, boundary - 1])
    idx = store.lookup(key, boundary)
    if idx is None:
        raise RuntimeError(
            f"dsv4_ascend: request slot {slot} resumes a cached prefix of {boundary} tokens, but no prefix "
            f"state is saved for it (token slot {key}); the radix cache must only report hits that "
            "DSV4RadixCache.match_prefix found a state for"
        )
    dev = cache.device
    q = torch.arange(boundary - store.window, boundary, device=dev)
    valid = q >= 0
    q4 = torch.arange(boundary - OVERLAP_ROWS, boundary, device=dev)
    for layer, st in enumerate(cache.layers):
        st.swa[slot, q[valid] % st.swa.shape[1]] = store.swa[layer][idx][valid]
        for name, (kv, gate) in store.rows[layer].items():
            ring_kv, ring_gate = st.rows[name]
            ring_kv[slot, q4 % ring_kv.shape[1]] = kv[idx]
            ring_gate[slot, q4 % ring_gate.shape[1]] = gate[idx]
