"""The `dsv4_ascend` attention backend: turns SGLang's ForwardBatch into per-request segments over
the DSV4 cache, once per forward, for the DeepSeek-V4 model to use.

Our model calls its attention directly (one function per layer over all segments) instead of going
through RadixAttention -> backend.forward per layer, because DSV4 attention is not "q, k, v in,
o out": it owns compressors, an indexer and per-request rings. The backend's job is the batch
geometry and the pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from ..models.dsv4_core import Segment


@dataclass
class DSV4ForwardMetadata:
    segments: list  # [Segment], in token order


def segments_from_batch(forward_batch) -> list:
    """Per-request (slot, start, length) from a ForwardBatch, for extend, decode and mixed modes."""
    mode = forward_batch.forward_mode
    if mode.is_idle():
        return []
    slots = forward_batch.req_pool_indices.tolist()
    positions = forward_batch.positions
    if mode.is_decode():
        return [Segment(s, int(p), 1) for s, p in zip(slots, positions.tolist())]
    lens = forward_batch.extend_seq_lens_cpu
    lens = lens.tolist() if isinstance(lens, torch.Tensor) else list(lens)
    segs, off = [], 0
    for s, n in zip(slots, lens):
        segs.append(Segment(s, int(positions[off]), int(n)))
        off += n
    return segs


class DSV4AscendBackend(AttentionBackend):
    def __init__(self, model_runner):
        super().__init__()
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.forward_metadata = None

    @property
    def cache(self):
        return self.token_to_kv_pool.cache

    def init_forward_metadata(self, forward_batch):
        self.forward_metadata = DSV4ForwardMetadata(segments_from_batch(forward_batch))

    def get_cuda_graph_seq_len_fill_value(self):
        return 1

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int):
        raise NotImplementedError("dsv4_ascend has no graph capture yet; run with graphs disabled")

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, **kw):
        raise NotImplementedError("dsv4_ascend serves only the sglang_dsv4_ascend DeepSeek-V4 model, "
                                  "which does not go through RadixAttention")

    forward_decode = forward_extend


def create_dsv4_ascend_backend(model_runner):
    return DSV4AscendBackend(model_runner)
