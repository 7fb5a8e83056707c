"""DSV4Cache: all DeepSeek-V4 per-request state as plain tensors (no SGLang imports).

One allocation for `num_slots` request slots (a slot = SGLang's req_pool_idx). Per layer:

* SWA raw KV ring      [S, sliding_window + spec_slack, head_dim]           row = position % ring
* compressor input rows (projected kv and gate of the incomplete windows, fp32), rings keyed the
  same way: CSA keeps the previous and the current 4-token block (overlapping windows) = 8 rows,
  HCA the current 128-token block, the CSA indexer its own 8 rows; each ring has `spec_slack` extra.
* compressed entries   C4 KV [P//4, head_dim], C4 indexer keys [P//4, index_head_dim] (on a CSA
  layer that selects its own top-k: config.topk_source), C128 KV
  [P//128, head_dim], shared by all requests and paged like the token KV of other models: entry j
  of a request (positions [j*r, (j+1)*r)) lives at row token_slots[slot, j*r] // r, where
  token_slots maps (slot, position) to one of P token-slot ids. Under SGLang that map is
  `req_to_token` and P the KV pool size, so entries are allocated and freed with the request's
  pages; pages of a multiple of 128 tokens keep every block's ids contiguous and r-aligned. Used
  alone, the cache lays its slots out densely (P = num_slots * capacity rounded up to 128).

Validity is never stored: it is the caller's committed length L. A forward for (slot, start=L, n)
reads only positions < L (and entries < L // r), and writes rows keyed by absolute position. That is
the speculative contract: a verify pass writes rows at positions >= L; if they are rejected L does
not move and later writes overwrite them. Because each ring has `spec_slack` rows more than the
model ever needs, a verify of k <= spec_slack rows never clobbers a committed row still in use, and
the only entries it can complete are j >= L // r, which are invalid at L.

Computing new rows and storing them are separate steps (`batch.SegmentWrites` / `batch.LayerWrites`,
then `write` / `store_layer`), so a forward can defer its writes and store only the accepted prefix
(`apply(pending, accepted)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..batch import COMPRESSOR, INDEXER, LayerWrites, SegmentWrites
from ..names import PAGE_SIZE
from .prefix_state import PrefixStates, restore_state, save_states, state_lists


@dataclass
class _LayerState:
    ratio: int
    kv: torch.Tensor  # [S * ring + P // ratio, head_dim]: the SWA ring rows, then the compressed entries
    swa: torch.Tensor  # view of kv: [S, ring, head_dim]
    rows: dict  # name -> (kv ring, gate ring)
    entries: dict  # name -> [P // ratio, dim], row = token-slot id of the block's first token // ratio


ENTRY_ALIGN = PAGE_SIZE  # every compression ratio divides it; token-slot pages must be multiples of it


class DSV4Cache:
    def __init__(
        self,
        cfg,
        num_slots: int,
        max_context_len: int,
        spec_slack: int = 0,
        dtype=torch.float32,
        device=None,
        ratios=None,
        token_slots=None,
        num_token_slots=None,
    ):
        """`ratios` defaults to the config's main layers (drafts can pass their own, all 0).
        `token_slots` [num_slots, >= max_context_len + spec_slack] (SGLang's req_to_token) and
        `num_token_slots` (its pool size) page the compressed entries; without them the cache
        lays each slot out densely."""
        if num_slots <= 0 or max_context_len <= 0 or spec_slack < 0:
            raise ValueError(
                f"DSV4Cache: num_slots={num_slots}, max_context_len={max_context_len}, spec_slack={spec_slack}; "
                "expected num_slots > 0, max_context_len > 0, spec_slack >= 0"
            )
        self.cfg, self.num_slots, self.max_context_len = cfg, num_slots, max_context_len
        self.spec_slack, self.dtype, self.device = spec_slack, dtype, device
        self.capacity = max_context_len + spec_slack  # highest position + 1 a forward may write
        self.window_ring = cfg.sliding_window + spec_slack
        if token_slots is None:
            stride = -(-self.capacity // ENTRY_ALIGN) * ENTRY_ALIGN
            token_slots = torch.arange(num_slots * stride, device=device).view(num_slots, stride)
            num_token_slots = num_slots * stride
        elif num_token_slots is None or token_slots.shape[0] < num_slots or token_slots.shape[1] < self.capacity:
            raise ValueError(
                f"DSV4Cache: token_slots {tuple(token_slots.shape)} / num_token_slots "
                f"{num_token_slots} must cover {num_slots} slots x {self.capacity} positions"
            )
        self.token_slots, self.num_token_slots = token_slots, num_token_slots
        self.key_slots = token_slots  # what prefix states are keyed by (a draft cache: the target's)
        # One scratch request slot (its rings) and one scratch entry row per store, never read by a
        # real request: the padding rows of a static-shape plan (plan.Bucket) write there, so a
        # padded forward has the same write lists every step without touching live state.
        self.pad_slot = num_slots
        self.swa_rows_total = (num_slots + 1) * self.window_ring  # kv-store rows before the entries
        if ratios is None:  # the main layers: a CSA layer that reuses another's top-k keeps no indexer keys
            ratios = cfg.compress_ratios
            indexed = [cfg.computes_topk(i) for i in range(len(ratios))]
        else:
            ratios = tuple(ratios)
            indexed = [r == 4 for r in ratios]
        self.layers = [self._alloc(r, ix) for r, ix in zip(ratios, indexed)]
        self.prefix: PrefixStates | None = None  # states at page boundaries, for prefix (radix) hits

    def enable_prefix_states(
        self, capacity: int | None = None, page: int = None, link: PrefixStates | None = None, key_slots=None
    ) -> PrefixStates:
        """Save a state at every page boundary a store step completes (prefix_state.py), so a
        request can resume a prefix another one computed: `restore_prefix`. A draft cache passes
        the target's store as `link` and the target's token slots as `key_slots` (states are
        keyed by the target's token slot of position boundary - 1)."""
        page = page or ENTRY_ALIGN
        if key_slots is not None:
            self.key_slots = key_slots
        if page % ENTRY_ALIGN:
            raise ValueError(
                f"DSV4Cache: prefix states need page boundaries that close every block; "
                f"page {page} is not a multiple of {ENTRY_ALIGN}"
            )
        if capacity is None:
            capacity = PrefixStates.default_capacity(self.num_token_slots, page)
        self.prefix = PrefixStates(self, capacity, page, link=link)
        return self.prefix

    def restore_prefix(self, slot: int, length: int) -> None:
        """Make `slot` resume a prefix of `length` tokens whose entries its token slots already
        map to (a radix hit): its window and open compressor rows come from the saved state."""
        if self.prefix is None:
            raise RuntimeError("DSV4Cache.restore_prefix: prefix states are not enabled")
        restore_state(self.prefix, self, slot, length)

    def state_lists(self, segs: list, device=None):
        """Reserve and locate the prefix states a store step of `segs` (slot, start, stored n,
        first new row) completes; None when prefix states are off or it completes none."""
        if self.prefix is None:
            return None
        rows_ring = self.rows_ring(4) if any(st.ratio == 4 for st in self.layers) else None
        return state_lists(
            self.prefix, segs, self.window_ring, rows_ring, self.key_slots, self.device if device is None else device
        )

    def _alloc(self, ratio: int, indexed: bool) -> _LayerState:
        cfg, S = self.cfg, self.num_slots + 1  # + the scratch slot
        D, Di = cfg.head_dim, cfg.index_head_dim

        def zeros(*shape, dtype=self.dtype):
            return torch.zeros(*shape, dtype=dtype, device=self.device)

        # One tensor holds what attention reads (window rows and the layer's compressed entries), so
        # the batched forward addresses every committed key of a layer with one index space.
        n_swa = self.swa_rows_total
        kv = zeros(n_swa + (self.pad_entry_row(ratio) + 1 if ratio else 0), D)
        swa = kv[:n_swa].view(S, self.window_ring, D)
        rows, entries = {}, {}
        if ratio:
            overlap = ratio == 4
            ring = self.rows_ring(ratio)
            width = 2 * D if overlap else D
            # Rows stay fp32 (tiny) so an entry pooled across forwards equals one pooled in one pass.
            rows[COMPRESSOR] = (zeros(S, ring, width, dtype=torch.float32), zeros(S, ring, width, dtype=torch.float32))
            entries[COMPRESSOR] = kv[n_swa:]
            if indexed:
                rows[INDEXER] = (
                    zeros(S, ring, 2 * Di, dtype=torch.float32),
                    zeros(S, ring, 2 * Di, dtype=torch.float32),
                )
                entries[INDEXER] = zeros(self.pad_entry_row(ratio) + 1, Di)
        return _LayerState(ratio, kv, swa, rows, entries)

    def pad_entry_row(self, ratio: int) -> int:
        """The scratch row of a ratio's entry stores (after every token slot's entry)."""
        return self.num_token_slots // ratio

    def rows_ring(self, ratio: int) -> int:
        """Rows a compressor must remember: its incomplete block(s), plus the speculative slack."""
        return (2 * ratio if ratio == 4 else ratio) + self.spec_slack

    # -- reads (positions < the committed length only) --------------------------------------------
    def _ring_index(self, p0: int, p1: int, ring: int):
        if p1 - p0 > ring:
            raise ValueError(f"DSV4Cache: asked for {p1 - p0} rows from a ring of {ring}")
        return torch.arange(p0, p1, device=self.device) % ring

    def swa_rows(self, layer: int, slot: int, p0: int, p1: int) -> torch.Tensor:
        """Roped KV rows of positions [p0, p1)."""
        st = self.layers[layer]
        return st.swa[slot, self._ring_index(p0, p1, st.swa.shape[1])]

    def compressor_rows(self, layer: int, name: str, slot: int, p0: int, p1: int):
        """(kv, gate) projected rows of positions [p0, p1), fp32."""
        kv, gate = self.layers[layer].rows[name]
        idx = self._ring_index(p0, p1, kv.shape[1])
        return kv[slot, idx], gate[slot, idx]

    def entry_rows(self, slot: int, ratio: int, j0: int, j1: int) -> torch.Tensor:
        """Rows of entries j0..j1-1 of `slot` in the shared entry tensors."""
        return self.token_slots[slot, j0 * ratio : j1 * ratio : ratio].long() // ratio

    def entries(self, layer: int, name: str, slot: int, n: int) -> torch.Tensor:
        """Compressed entries 0..n-1 of `slot` (gathered)."""
        st = self.layers[layer]
        return st.entries[name][self.entry_rows(slot, st.ratio, 0, n)]

    # -- writes ------------------------------------------------------------------------------------
    def write(self, w: SegmentWrites) -> None:
        if w.start + w.length > self.capacity:
            raise ValueError(
                f"DSV4Cache: slot {w.slot} writes positions up to {w.start + w.length - 1}, "
                f"beyond max_context_len + spec_slack = {self.capacity}"
            )
        st = self.layers[w.layer]
        if self.prefix is not None and w.length:
            states = self.state_lists([(w.slot, w.start, w.length, 0)], device=w.swa.device)
            if states is not None:  # read the ring before this write overwrites it
                save_states(self.prefix, w.layer, states, st, w.swa, w.rows)
        self._write_ring(st.swa, w.slot, w.start, w.swa)
        for name, (kv, gate) in w.rows.items():
            ring_kv, ring_gate = st.rows[name]
            self._write_ring(ring_kv, w.slot, w.start, kv)
            self._write_ring(ring_gate, w.slot, w.start, gate)
        for name, (j0, e) in w.entries.items():
            st.entries[name][self.entry_rows(w.slot, st.ratio, j0, j0 + e.shape[0])] = e.to(self.dtype)

    def store_layer(self, w: LayerWrites, accepted: dict | None = None, keep: tuple | None = None) -> None:
        """Store one layer's batched writes through its plan's lists (`accepted` / `keep` as in `apply`)."""
        lists = w.plan.writes(accepted, keep)
        st = self.layers[w.layer]
        states = lists.states(self)
        if states is not None:  # read the ring before this step overwrites it
            save_states(self.prefix, w.layer, states, st, w.swa, w.rows)
        st.kv[lists.swa_dst] = w.swa[lists.swa_src]
        for name, (kv, gate) in w.rows.items():
            src, dst = lists.rows[st.ratio]
            ring_kv, ring_gate = st.rows[name]
            ring_kv.view(-1, ring_kv.shape[-1])[dst] = kv[src]
            ring_gate.view(-1, ring_gate.shape[-1])[dst] = gate[src]
        for name, e in w.entries.items():
            idx, dst = lists.entries[st.ratio]
            st.entries[name][dst] = e[idx].to(st.entries[name].dtype)

    def _write_ring(self, ring: torch.Tensor, slot: int, start: int, rows: torch.Tensor) -> None:
        n, size = rows.shape[0], ring.shape[1]
        keep = min(n, size)  # older rows of a long segment would be overwritten anyway
        pos = torch.arange(start + n - keep, start + n, device=ring.device)
        ring[slot, pos % size] = rows[n - keep :].to(ring.dtype)

    def apply(self, pending: list, accepted: dict | None = None, keep: tuple | None = None) -> None:
        """Store deferred writes; `accepted[slot] = n` keeps only that segment's first n positions.
        `keep[i]` = n does the same by segment index, for every segment of the forward: a tree
        verify runs several segments per slot (one per root-to-leaf path) and stores one path's
        accepted prefix (n) and nothing of the others (0); a node-once tree segment
        (`Segment.parents`) keeps its accepted path, a tuple of node indices from the root."""
        if keep is not None and accepted is not None:
            raise ValueError("DSV4Cache.apply: pass `accepted` (by slot) or `keep` (by segment), not both")
        for w in pending:
            if isinstance(w, LayerWrites):
                self.store_layer(w, accepted, keep)
            elif keep is not None:
                if keep[w.seg]:
                    self.write(w.prefix(keep[w.seg]))
            else:
                self.write(w if accepted is None or w.slot not in accepted else w.prefix(accepted[w.slot]))

    def reset_slot(self, slot: int) -> None:
        """Forget a request: its rings and the entries its token slots map to. Not needed for
        correctness (validity is the committed length); it keeps freed slots clean for debugging
        and makes reuse byte-identical to a fresh cache."""
        for st in self.layers:
            st.swa[slot].zero_()
            for kv, gate in st.rows.values():
                kv[slot].zero_()
                gate[slot].zero_()
            for e in st.entries.values():
                e[self.entry_rows(slot, st.ratio, 0, self.capacity // st.ratio)] = 0

    # -- accounting --------------------------------------------------------------------------------
    def state_tensors(self) -> dict:
        """Every storage tensor: per-slot rings and the shared entry tensors."""
        out = {}
        for i, st in enumerate(self.layers):
            out[f"layers.{i}.swa"] = st.swa
            for name, (kv, gate) in st.rows.items():
                out[f"layers.{i}.{name}.rows_kv"], out[f"layers.{i}.{name}.rows_gate"] = kv, gate
            for name, e in st.entries.items():
                out[f"layers.{i}.{name}.entries"] = e
        return out

    def page_stores(self, page: int) -> list:
        """Every compressed-entry store with the bytes one token-slot page of it holds (page / r
        rows), in one fixed order: what PD moves by page (a request's other state: slot_tensors)."""
        out = []
        for st in self.layers:
            for name in sorted(st.entries):
                e = st.entries[name]
                out.append((e, page // st.ratio * e.shape[1] * e.element_size()))
        return out

    def slot_tensors(self) -> list:
        """Every tensor indexed by request slot first (the rings), in one fixed order: what a
        request's state is besides the entries its token slots map to (PD sends these per slot)."""
        out = []
        for st in self.layers:
            out.append(st.swa)
            for name in sorted(st.rows):
                out.extend(st.rows[name])
        return out

    def slot_state(self, slot: int) -> dict:
        """Copies of everything `slot` owns: its rings and its entries (through token_slots)."""
        out = {}
        for i, st in enumerate(self.layers):
            out[f"layers.{i}.swa"] = st.swa[slot].clone()
            for name, (kv, gate) in st.rows.items():
                out[f"layers.{i}.{name}.rows_kv"], out[f"layers.{i}.{name}.rows_gate"] = (
                    kv[slot].clone(),
                    gate[slot].clone(),
                )
            for name, e in st.entries.items():
                out[f"layers.{i}.{name}.entries"] = e[self.entry_rows(slot, st.ratio, 0, self.capacity // st.ratio)]
        return out

    def nbytes(self) -> dict:
        """Bytes per component over all slots: swa, compressor_rows, c4_kv, c4_index, c128_kv, total."""
        acc = dict.fromkeys(("swa", "compressor_rows", "c4_kv", "c4_index", "c128_kv"), 0)
        for st in self.layers:
            acc["swa"] += _nb(st.swa)
            acc["compressor_rows"] += sum(_nb(kv) + _nb(g) for kv, g in st.rows.values())
            if st.ratio == 4:
                acc["c4_kv"] += _nb(st.entries[COMPRESSOR])
                acc["c4_index"] += _nb(st.entries[INDEXER]) if INDEXER in st.entries else 0
            elif st.ratio == 128:
                acc["c128_kv"] += _nb(st.entries[COMPRESSOR])
        acc["total"] = sum(acc.values())
        return acc

    def bytes_per_token(self) -> float:
        """Total state bytes divided by the token slots the entries are sized for."""
        return self.nbytes()["total"] / self.num_token_slots


def _nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
