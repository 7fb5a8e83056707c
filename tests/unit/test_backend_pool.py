"""The dsv4_ascend backend's batch geometry and the DSV4 KV pool, against hand-built
ForwardBatch-like objects that follow SGLang's conventions (decode: seq_lens counts the new token,
positions = seq_lens - 1; extend: extend_seq_lens_cpu per request, positions concatenated; MIXED:
decode rows are extend rows of length 1)."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_dsv4_ascend.attention_backend.backend import DSV4AscendBackend, segments_from_batch
from sglang_dsv4_ascend.attention_backend.pool import DSV4TokenToKVPool
from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.config import DSV4Config


def fb(mode, slots, positions, seq_lens, extend_lens=None):
    return SimpleNamespace(
        forward_mode=mode,
        req_pool_indices=torch.tensor(slots),
        positions=torch.tensor(positions),
        seq_lens=torch.tensor(seq_lens),
        seq_lens_cpu=torch.tensor(seq_lens),
        extend_seq_lens_cpu=extend_lens,
        batch_size=len(slots),
    )


def test_decode_segments_start_at_each_requests_position():
    # committed lengths 40, 7, 129 -> the new tokens sit at those positions; seq_lens include them
    b = fb(ForwardMode.DECODE, [3, 1, 9], [40, 7, 129], [41, 8, 130])
    assert segments_from_batch(b) == [Segment(3, 40, 1), Segment(1, 7, 1), Segment(9, 129, 1)]


def test_extend_segments_follow_extend_lens_and_positions():
    # slot 2: fresh prefill of 5; slot 0: second chunk 128..130 of a chunked prefill; slot 4: 1 token
    pos = [0, 1, 2, 3, 4, 128, 129, 130, 17]
    b = fb(ForwardMode.EXTEND, [2, 0, 4], pos, [5, 131, 18], extend_lens=[5, 3, 1])
    assert segments_from_batch(b) == [Segment(2, 0, 5), Segment(0, 128, 3), Segment(4, 17, 1)]
    # extend_seq_lens_cpu may arrive as a tensor
    b.extend_seq_lens_cpu = torch.tensor([5, 3, 1])
    assert segments_from_batch(b)[1] == Segment(0, 128, 3)


def test_segments_come_from_the_cpu_fields_not_device_positions():
    """Starts are read from extend_prefix_lens_cpu / seq_lens_cpu, which SGLang keeps on the host:
    positions (a device tensor on an accelerator) are poisoned here and must not be read."""
    b = fb(ForwardMode.EXTEND, [2, 0], [-1] * 4, [3, 129], extend_lens=[3, 1])
    b.extend_prefix_lens_cpu = [0, 128]
    assert segments_from_batch(b) == [Segment(2, 0, 3), Segment(0, 128, 1)]
    d = fb(ForwardMode.DECODE, [3, 1], [-1, -1], [41, 8])
    assert segments_from_batch(d) == [Segment(3, 40, 1), Segment(1, 7, 1)]


def test_mixed_batch_has_prefill_chunks_and_decode_rows():
    pos = [256, 257, 258, 259, 63, 300]
    b = fb(ForwardMode.MIXED, [5, 6, 7], pos, [260, 64, 301], extend_lens=[4, 1, 1])
    assert segments_from_batch(b) == [Segment(5, 256, 4), Segment(6, 63, 1), Segment(7, 300, 1)]


def test_idle_batch_has_no_segments():
    assert segments_from_batch(fb(ForwardMode.IDLE, [], [], [])) == []


@pytest.fixture(scope="module")
def cfg(tiny_ckpt):
    import json
    import os

    with open(os.path.join(tiny_ckpt("flash"), "config.json")) as f:
        return DSV4Config.from_hf(json.load(f))


def _pool(cfg, page_size=128, slots=3, ctx=512, size=1024):
    req_to_token = torch.zeros(slots, ctx, dtype=torch.int32)
    return DSV4TokenToKVPool(
        size=size,
        page_size=page_size,
        dtype=torch.float32,
        cfg=cfg,
        req_to_token=req_to_token,
        spec_slack=0,
        device="cpu",
    )


def test_pool_pages_entries_through_req_to_token(cfg):
    pool = _pool(cfg)
    c = pool.cache
    assert (c.num_slots, c.max_context_len, c.num_token_slots) == (3, 512, 1024 + 128)
    # C4 entries: one row per 4 token slots; C128: one per 128 (layer 3 of the flash preset is HCA)
    # (+ one scratch row each, where padding rows of a static plan write)
    assert c.layers[2].entries["compressor"].shape[0] == (1024 + 128) // 4 + 1
    assert c.layers[3].entries["compressor"].shape[0] == (1024 + 128) // 128 + 1
    assert pool.get_kv_size_bytes() == c.nbytes()["total"] > 0


def test_pool_refuses_what_it_cannot_hold(cfg):
    with pytest.raises(ValueError, match="--page-size 100 must be a multiple of every compression ratio"):
        _pool(cfg, page_size=100)
    pool = _pool(cfg)
    with pytest.raises(NotImplementedError, match="no per-token K/V buffers"):
        pool.get_key_buffer(0)
    with pytest.raises(NotImplementedError):
        pool.set_kv_buffer(None, None, None, None)


def test_backend_builds_segments_once_per_forward_and_refuses_radix_attention(cfg):
    pool = _pool(cfg)
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_to_token=pool.cache.token_slots), token_to_kv_pool=pool
    )
    backend = DSV4AscendBackend(runner)
    assert backend.cache is pool.cache
    backend.init_forward_metadata(fb(ForwardMode.DECODE, [2], [10], [11]))
    assert backend.forward_metadata.segments == [Segment(2, 10, 1)]
    plan = backend.forward_metadata.plan  # the batched path's geometry, built here once per forward
    assert plan.T == 1 and plan.row_slot.tolist() == [2] and plan.row_pos.tolist() == [10]
    with pytest.raises(NotImplementedError, match="does not go through RadixAttention"):
        backend.forward_extend(None, None, None, None, None)
