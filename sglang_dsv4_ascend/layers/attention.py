"""DeepSeek-V4 attention (reference §1.4): shared-KV MQA over SWA rows + compressed entries.

Per token (x = the sublayer input after mHC pre and attn_norm):
    q_lat = RMSNorm_{q_norm}(W_qa x);  q_h = RoPE(rms(W_qb q_lat)_h)     (per-head norm, no weight)
    kv    = RoPE(RMSNorm_{kv_norm}(W_kv x))                               (one vector = key = value)
Key set of a query at t: the raw kv of positions t-W+1..t (W = sliding_window, including itself),
plus compressed entries: CSA (ratio 4) the indexer's top-k visible ones, HCA (ratio 128) all visible
ones (j < (t+1)//r). Softmax with a per-head sink in the denominator, scale head_dim^-1/2. The output's
rope channels are rotated back (-angle of t), then the grouped low-rank projection
    y = W_ob concat_g(W_oa,g concat(o_h for h in group g)).

Row-wise projections run over the whole forward at once; everything touching a request's history
runs per segment against the cache. New rows are collected in a `SegmentWrites` and stored after the
segment's reads (or handed back when the caller defers writes).
"""

from __future__ import annotations

import torch
from torch import nn

from .. import ops, settings
from ..batch import COMPRESSOR, INDEXER, LayerWrites, SegmentWrites
from ..distributed.layout import Layout
from ..ops.reference import Source, pad_rows
from . import SMALL_M, Linear, RMSNorm
from .compressor import Compressor
from .indexer import Indexer, TopkCarry
from .rope import Rotary


class Attention(nn.Module):
    def __init__(self, cfg, layer_id: int, dtype=None, device=None, layout: Layout | None = None):
        super().__init__()
        self.cfg, self.layer_id, self.ratio = cfg, layer_id, cfg.compress_ratios[layer_id]
        # Attention TP (distributed/layout.py): this rank's heads, as whole output groups; the
        # shared KV head, compressors and indexer are replicated.
        self.layout = layout or Layout()
        # With more ranks than output groups a rank holds part of one group's heads: its wo_a
        # columns for them and that group's wo_b columns, whose product is a partial sum too.
        tp = self.layout.attn_tp_size
        H, G, D, d = cfg.num_attention_heads // tp, max(1, cfg.o_groups // tp), cfg.head_dim, cfg.hidden_size
        self.n_heads, self.o_groups = H, G
        self.head_dim, self.window, self.eps = D, cfg.sliding_window, cfg.rms_norm_eps
        kw = dict(bias=False, dtype=dtype, device=device)
        self.wq_a = Linear(d, cfg.q_lora_rank, **kw)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.wq_b = Linear(cfg.q_lora_rank, H * D, **kw)
        self.wkv = Linear(d, D, **kw)
        self.kv_norm = RMSNorm(D, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.wo_a = Linear(H * D // G, G * cfg.o_lora_rank, **kw)  # this rank's heads of each of its groups
        self.wo_b = Linear(G * cfg.o_lora_rank, d, **kw)
        self.attn_sink = nn.Parameter(torch.zeros(H, dtype=torch.float32, device=device))
        self.rotary = Rotary(cfg.rope_for(layer_id), device=device)
        self.compressor = Compressor(cfg, self.ratio, D, dtype, device) if self.ratio else None
        # IndexCache (config.topk_source): only a group's source CSA layer has an indexer; the
        # group's other CSA layers attend with its top-k (`topk_carry`, shared by the group, linked
        # by the model) and neither project, pool nor store indexer keys: nothing would read them,
        # since every later selection of the group is the source's. The cache allocates no indexer
        # store for them (kvcache/cache.py), prefix states hold none, and the checkpoint's tensors
        # for them are not loaded (config.is_dropped_tensor). `index_topk_freq` is fixed for a
        # server's life (a model-config field), so every prefix hit is served under the freq that
        # wrote it.
        computes = self.ratio == 4 and cfg.computes_topk(layer_id)
        self.indexer = Indexer(cfg, dtype, device) if computes else None
        self.reuses_topk = self.ratio == 4 and not computes
        self.topk_carry = TopkCarry() if self.ratio == 4 else None

    def _project(self, x, positions):
        cos, sin = self.rotary(positions)
        q_lat = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_lat).unflatten(-1, (self.n_heads, self.head_dim))
        q = ops.apply_rope(ops.rms_norm(q, None, self.eps), cos, sin)
        kv = ops.apply_rope(self.kv_norm(self.wkv(x)), cos, sin)
        return cos, sin, q_lat, q, kv

    def _finish(self, out, cos, sin):
        out = ops.apply_rope(out, cos, sin, inverse=True)
        # wo_b is row-parallel over the groups: each rank holds a partial sum.
        return self.layout.attn_all_reduce(self.wo_b(self._grouped_wo_a(out)))

    def forward(self, x, positions, segments, cache, pending: list | None = None, plan=None) -> torch.Tensor:
        """The batched path when a `plan` (kvcache/plan.py) is given, else the per-segment
        definition (`forward_segments`), which the tests use as the oracle."""
        if plan is None:
            return self.forward_segments(x, positions, segments, cache, pending)
        return self.forward_batched(x, positions, plan, cache, pending)

    def forward_batched(self, x, positions, plan, cache, pending: list | None = None) -> torch.Tensor:
        """All segments at once: a fixed number of batched ops whatever the batch holds. Keys come
        from two pools read in place through the plan's index lists: the layer's committed store
        (SWA ring rows, then compressed entries) and this forward's fresh rows (new SWA rows,
        then the entries this forward completes)."""
        cos, sin, q_lat, q, kv = self._project(x, positions)
        st, T = cache.layers[self.layer_id], plan.T
        n_swa = cache.swa_rows_total
        kv = kv.to(cache.dtype)
        rows, entries, fresh_parts, extra = {}, {}, [kv], []
        zeros = plan.zeros()
        if self.compressor is not None:
            rp = plan.ratios[self.ratio]
            rows[COMPRESSOR] = self.compressor.project(x)
            entries[COMPRESSOR] = self.compressor.pool_batched(
                rows[COMPRESSOR], st.rows[COMPRESSOR], rp, self.rotary, cache.dtype
            )
            fresh_parts.append(entries[COMPRESSOR])
        fresh = torch.cat(fresh_parts) if len(fresh_parts) > 1 else kv
        if self.indexer is not None:
            rows[INDEXER] = self.indexer.compressor.project(x)
            entries[INDEXER] = self.indexer.compressor.pool_batched(
                rows[INDEXER], st.rows[INDEXER], rp, self.rotary, cache.dtype
            )
            qi, wi = self.indexer.queries(q_lat, x, cos, sin)
            committed = Source(st.entries[INDEXER], rp.slot_entries, plan.row_slot, zeros, rp.com_hi, None, 4)
            completed = Source(entries[INDEXER], rp.new_table, plan.row_seg, zeros, rp.new_hi, rp.new_mask)
            picks_com, picks_new = self.indexer.select_batched(
                qi, wi, committed, completed, rp, T, n_swa, plan.host_groups
            )
            self.topk_carry.put(plan, (picks_com, picks_new))
            extra = [picks_com._replace(pool=st.kv), picks_new._replace(pool=fresh)]
        elif self.reuses_topk:  # the group source's picks: entry numbers, layer-independent rows
            picks_com, picks_new = self.topk_carry.take(plan)
            extra = [picks_com._replace(pool=st.kv), picks_new._replace(pool=fresh)]
        elif self.compressor is not None:  # HCA: every visible entry
            extra = [
                Source(st.kv, rp.slot_entries, plan.row_slot, zeros, rp.com_hi, None, self.ratio, n_swa),
                Source(fresh, rp.new_table, plan.row_seg, zeros, rp.new_hi, rp.new_mask, 1, T),
            ]
        window = fresh
        if plan.past_kv is not None:  # tree nodes an earlier forward computed (plan.py), after the T rows
            if self.compressor is not None:
                raise ValueError("past tree nodes (plan.past_kv) are for SWA-only layers")
            window = torch.cat([kv, plan.past_kv[self.layer_id].to(kv.dtype)])
        sources = [
            Source(st.kv, plan.swa_com, None, plan.swa_com_lo, plan.swa_com_hi),
            Source(window, plan.swa_fresh, None, plan.swa_fresh_lo, plan.swa_fresh_hi),
        ] + extra
        out = ops.sparse_attention_sources(q, sources, self.attn_sink, self.head_dim**-0.5)
        writes = LayerWrites(self.layer_id, plan, kv, rows, entries)
        if pending is None:
            cache.store_layer(writes)
        else:
            pending.append(writes)
        return self._finish(out, cos, sin)

    def forward_segments(self, x, positions, segments, cache, pending: list | None = None) -> torch.Tensor:
        """The definition: each segment against the cache in turn."""
        if any(s.parents is not None for s in segments):
            raise ValueError(
                f"tree segments (node-once verify) run on the batched path only, not {settings.ATTENTION.name}=segments"
            )
        cos, sin, q_lat, q, kv = self._project(x, positions)
        rows = {}
        if self.compressor is not None:
            rows[COMPRESSOR] = self.compressor.project(x)
        if self.indexer is not None:
            rows[INDEXER] = self.indexer.compressor.project(x)
            qi, wi = self.indexer.queries(q_lat, x, cos, sin)

        out = torch.empty_like(q)
        offset = 0
        picks = [] if self.indexer is not None else None
        for i, seg in enumerate(segments):
            sl = slice(offset, offset + seg.length)
            offset += seg.length
            w = SegmentWrites(self.layer_id, seg.slot, seg.start, seg.length, self.ratio, kv[sl], seg=i)
            w.rows = {name: (k[sl], g[sl]) for name, (k, g) in rows.items()}
            pool, idx, valid = self._window(cache, seg, kv[sl], positions[sl])
            if self.compressor is not None:
                entries = self._entries(cache, seg, w, COMPRESSOR, self.compressor)
                if self.indexer is not None:
                    keys = self._entries(cache, seg, w, INDEXER, self.indexer.compressor)
                    sel, ok = self.indexer.select(qi[sl], wi[sl], keys, positions[sl])
                    picks.append((sel, ok))
                elif self.reuses_topk:  # the group source's selection for this segment
                    sel, ok = self.topk_carry.take(segments)[i]
                else:  # HCA: every visible entry
                    sel = torch.arange(entries.shape[0], device=x.device).expand(seg.length, -1)
                    ok = sel < ((positions[sl] + 1) // self.ratio)[:, None]
                idx = torch.cat([idx, sel + pool.shape[0]], dim=1)
                valid = torch.cat([valid, ok], dim=1)
                pool = torch.cat([pool, entries])
            out[sl] = ops.sparse_attention_with_sink(q[sl], pool, idx, valid, self.attn_sink, self.head_dim**-0.5)
            if pending is None:
                cache.write(w)
            else:
                pending.append(w)
        if picks is not None:
            self.topk_carry.put(segments, picks)
        return self._finish(out, cos, sin)

    def _window(self, cache, seg, kv_new, positions):
        """Raw-KV pool of positions [p0, start+n) and each query's window rows in it (ascending)."""
        p0 = max(0, seg.start - self.window + 1)
        pool = kv_new.to(cache.dtype)
        if p0 < seg.start:
            pool = torch.cat([cache.swa_rows(self.layer_id, seg.slot, p0, seg.start), pool])
        last = positions - p0  # the query's own row
        idx = last[:, None] - (self.window - 1) + torch.arange(self.window, device=positions.device)
        return pool, idx, idx >= 0

    def _entries(self, cache, seg, w: SegmentWrites, name: str, compressor: Compressor):
        """All compressed entries visible to the segment's last token: cached ones + newly completed."""
        j0, new = compressor.segment_entries(
            w.rows[name],
            seg.start,
            lambda p0, p1: cache.compressor_rows(self.layer_id, name, seg.slot, p0, p1),
            self.rotary,
            cache.dtype,
        )
        w.entries[name] = (j0, new)
        return torch.cat([cache.entries(self.layer_id, name, seg.slot, j0), new])

    def _grouped_wo_a(self, o: torch.Tensor) -> torch.Tensor:
        """Group g's heads (contiguous) -> o_lora via its own block of wo_a; groups concatenated."""
        G, T = self.o_groups, o.shape[0]
        # a few fp32 rows take the batched matmul's small-M kernels: padded, as layers.Linear
        groups = (pad_rows(o) if o.dtype == torch.float32 and T < SMALL_M else o).flatten(1).unflatten(-1, (G, -1))
        wa = self.wo_a.weight.unflatten(0, (G, -1))  # [G, o_lora, H*D/G]
        return torch.einsum("tgi,gri->tgr", groups, wa).flatten(1)[:T]
