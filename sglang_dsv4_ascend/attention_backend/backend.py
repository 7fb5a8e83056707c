"""The `dsv4_ascend` attention backend: turns SGLang's ForwardBatch into per-request segments over
the DSV4 cache, once per forward, for the DeepSeek-V4 model to use.

Our model calls its attention directly (one function per layer over all segments) instead of going
through RadixAttention -> backend.forward per layer, because DSV4 attention is not "q, k, v in,
o out": it owns compressors, an indexer and per-request rings. The backend's job is the batch
geometry and the pools.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from .. import settings
from ..batch import DSV4ForwardMetadata, Segment
from ..kvcache import plan as kv_plan

logger = logging.getLogger("sglang_dsv4_ascend")

# SGLang never hands request slot 0 to a request (ReqToTokenPool's free list starts at 1): graph
# runners point their padding rows at it.
PADDING_SLOT = 0


def _cpu_list(x) -> list:
    return x.tolist() if isinstance(x, torch.Tensor) else list(x)


def _decode_seq_lens(forward_batch) -> list:
    """A decode batch's sequence lengths (committed length + 1 per row), from the host copy."""
    seq_lens = getattr(forward_batch, "seq_lens_cpu", None)
    if seq_lens is None:  # older batches: positions are the decode rows' starts
        seq_lens = forward_batch.positions.cpu() + 1
    return [int(n) for n in _cpu_list(seq_lens)]


def segments_from_batch(forward_batch) -> list:
    """Per-request (slot, start, length) from a ForwardBatch, for extend, decode and mixed modes.

    Read from SGLang's CPU-side fields (seq_lens_cpu, extend_prefix_lens_cpu, extend_seq_lens_cpu)
    so that building the geometry never waits on the device; device tensors are read only where
    SGLang keeps no CPU copy (req_pool_indices, which SGLang itself fills from a host list)."""
    mode = forward_batch.forward_mode
    if mode.is_idle():
        return []
    slots = _cpu_list(forward_batch.req_pool_indices.cpu())
    # Under DP attention SGLang pads a decode batch with dummy requests (slot 0) up to the largest
    # DP rank's batch: they are not ours to attend or store.
    real_bs = getattr(forward_batch, "_original_batch_size", None)
    if real_bs is not None:
        slots = slots[:real_bs]
    if mode.is_decode():
        return [Segment(s, n - 1, 1) for s, n in zip(slots, _decode_seq_lens(forward_batch))]
    lens = _cpu_list(forward_batch.extend_seq_lens_cpu)
    prefix = getattr(forward_batch, "extend_prefix_lens_cpu", None)
    if prefix is None:
        starts, off = [], 0
        for n in lens:
            starts.append(int(forward_batch.positions[off]))
            off += n
    else:
        starts = _cpu_list(prefix)
    return [Segment(s, int(p), int(n)) for s, p, n in zip(slots, starts, lens)]


class DSV4AscendBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.forward_metadata = None
        # The per-segment definition (SGLANG_DSV4_ATTENTION=segments) needs no plan.
        self.build_plans = settings.ATTENTION.get() == "batched"
        self._slot_generation: dict = {}  # req slot -> SGLang's allocation generation we last saw
        self.resumed: list = []
        self.graph_plans = None  # kvcache/plan.py PlanBuffers once a graph runner asks for graph state
        self.graph_bs: set = set()  # captured decode batch sizes
        self.graph_context = None  # Bucket.context of the captured decodes (kv_plan.graph_context)
        self._replayed: set = set()

    @property
    def cache(self):
        return self.token_to_kv_pool.cache

    def init_forward_metadata(self, forward_batch):
        """The forward's geometry, once: the segments and, for the batched path, every index table
        the layers gather through (built on the host from CPU fields, then copied to the device).
        A decode batch of a captured size gets its bucket's persistent plan (graph replay)."""
        segments = segments_from_batch(forward_batch)
        static = forward_batch.forward_mode.is_decode() and forward_batch.batch_size in self.graph_bs
        if static:  # the graph runner's padding rows (SGLang's reserved request slot) are not requests
            segments = [s for s in segments if s.slot != PADDING_SLOT]
            # a request past the captured context: the runner ran this step eager (graph_holds)
            static = kv_plan.fits((s.start for s in segments), self.graph_context)
        if self.cache.prefix is not None:
            self._resume_prefix_hits(segments)
            self._want_hinted_states(segments, getattr(forward_batch, "rids", None))
        plan = None
        if static:
            bucket = kv_plan.Bucket(forward_batch.batch_size, 1, self.graph_context)
            plan = self.graph_plans.load(segments, bucket)
            if bucket not in self._replayed:
                self._replayed.add(bucket)
                logger.info("dsv4_ascend: first replay of the captured decode, batch size %d", bucket.rows)
        elif segments and self.build_plans:
            plan = kv_plan.build_plan(segments, self.cache)
        self.forward_metadata = DSV4ForwardMetadata(segments, plan)

    # Graph capture through SGLang's graph runners (CPUGraphRunner: torch.compile per batch size;
    # the CUDA / NPU runners: device graphs). A captured decode step reads one persistent plan per
    # batch size (kvcache/plan.py PlanBuffers), refreshed in place before every replay by
    # `init_forward_metadata`, which every runner calls outside the captured region. Only the
    # non-speculative decode is captured here; the speculative worker runs eager.

    def init_cpu_graph_state(self, max_bs: int, max_num_tokens: int):
        if not self.build_plans:
            raise ValueError(
                f"graph capture needs the batched attention path; unset {settings.ATTENTION.name}=segments "
                "or run without --enable-torch-compile"
            )
        self.graph_plans = kv_plan.PlanBuffers(self.cache)
        self.graph_context = kv_plan.graph_context(self.cache, settings.GRAPH_CONTEXT.get())
        if self.graph_context is not None:
            logger.info(
                "dsv4_ascend: captured decodes hold contexts up to %d tokens (%s); longer requests decode eager",
                self.graph_context,
                settings.GRAPH_CONTEXT.name,
            )

    init_cuda_graph_state = init_cpu_graph_state

    def graph_holds(self, forward_batch) -> bool:
        """Whether a captured decode holds this batch's requests (the graph runner asks before it
        replays, `integration/graph_runner.py`): none has more committed tokens than the captured
        context. `init_forward_metadata` makes the same test, so a step the runner runs eager gets
        an eager plan. Only the sequence lengths are read (the batch's segments are built once,
        by `init_forward_metadata`)."""
        if self.graph_context is None:
            return True
        return kv_plan.fits((n - 1 for n in _decode_seq_lens(forward_batch)), self.graph_context)

    def init_forward_metadata_capture_cpu_graph(
        self, bs, num_tokens, req_pool_indices, seq_lens, out_cache_loc, encoder_lens, forward_mode, spec_info
    ):
        """Capture of batch size `bs`: every row is padding (the runner fills the reserved slot)."""
        if not forward_mode.is_decode() or num_tokens != bs:
            raise ValueError(f"dsv4_ascend captures decode batches only (one row per request), got {forward_mode}")
        self.graph_bs.add(bs)
        self.forward_metadata = DSV4ForwardMetadata(
            [], self.graph_plans.load([], kv_plan.Bucket(bs, 1, self.graph_context))
        )

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False):
        """The CUDA / NPU graph runners' host step (unverified on those devices: no such runner has
        run this backend)."""
        bs = forward_batch.batch_size
        if in_capture:
            self.init_forward_metadata_capture_cpu_graph(
                bs, bs, None, None, None, None, forward_batch.forward_mode, forward_batch.spec_info
            )
        else:
            self.init_forward_metadata(forward_batch)

    def _resume_prefix_hits(self, segments) -> None:
        """A request slot SGLang allocated since we last saw it, whose first segment starts past
        0, starts from a radix hit: its window and open compressor rows come from the prefix
        state saved at that boundary (its entries are already on the tree's token slots). Slot
        reuse is told by SGLang's per-row allocation generation (a host tensor)."""
        generation = self.req_to_token_pool.req_generation
        self.resumed = []  # (slot, length) restored in this forward (a speculative worker's draft follows)
        for seg in segments:
            g = int(generation[seg.slot])
            if self._slot_generation.get(seg.slot) != g:
                self._slot_generation[seg.slot] = g
                if seg.start > 0:
                    self.cache.restore_prefix(seg.slot, seg.start)
                    self.resumed.append((seg.slot, seg.start))

    def _want_hinted_states(self, segments, rids) -> None:
        """Branching points the radix cache asked for (`PrefixStates.hint`) that this forward's
        segments complete: their states are kept (the store's protected segment)."""
        states = self.cache.prefix
        states.wanted = set()
        if not rids or not states.hints:
            return
        for seg, rid in zip(segments, rids):
            b = states.hints.get(rid)
            if b is not None and seg.start < b <= seg.start + seg.length:
                states.wanted.add((seg.slot, b))
                del states.hints[rid]

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    # What SGLang's DP-attention padding fills the dummy requests' seq_lens with on CPU.
    get_cpu_graph_seq_len_fill_value = get_cuda_graph_seq_len_fill_value

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
        raise NotImplementedError(
            "dsv4_ascend serves only the sglang_dsv4_ascend DeepSeek-V4 model, which does not go through RadixAttention"
        )

    forward_decode = forward_extend


def create_dsv4_ascend_backend(model_runner):
    return DSV4AscendBackend(model_runner)
