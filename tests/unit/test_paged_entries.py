"""Compressed entries paged through a token-slot map (SGLang's req_to_token): scattered, interleaved
pages shared by two requests give the same logits as one full forward, and a request's entries
land exactly in the rows its pages own."""

import torch

from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.kvcache.cache import DSV4Cache

PAGE = 128


def _token_slots(num_slots, length, num_pages, seed=0):
    """Each slot gets its own random pages (like SGLang's paged allocator), page 0 left unused."""
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(seed)) + 1
    pages_per_slot = -(-length // PAGE)
    table = torch.zeros(num_slots, pages_per_slot * PAGE, dtype=torch.int32)
    for s in range(num_slots):
        pages = order[s * pages_per_slot : (s + 1) * pages_per_slot]
        table[s] = (pages[:, None] * PAGE + torch.arange(PAGE)).flatten().int()
    return table


def test_scattered_pages_equal_full_forward(dsv4_model):
    model = dsv4_model("flash")
    L, slots, num_pages = 300, 2, 16
    table = _token_slots(slots, L, num_pages)
    cache = DSV4Cache(model.cfg, slots, L, token_slots=table, num_token_slots=num_pages * PAGE)
    for t in cache.state_tensors().values():
        t.fill_(float("nan"))  # any row read that the request does not own turns the logits NaN
    a = torch.randint(0, 1024, (L,), generator=torch.Generator().manual_seed(12))
    b = torch.randint(0, 1024, (L,), generator=torch.Generator().manual_seed(29))

    def run(ids, pos, segs):
        return model.compute_logits(model(ids, pos, segs, cache))

    # Both requests prefill in interleaved chunks, in the same forwards.
    outs = {0: [], 1: []}
    for s0, n in [(0, 100), (100, 157), (257, 43)]:
        ids = torch.cat([a[s0 : s0 + n], b[s0 : s0 + n]])
        pos = torch.cat([torch.arange(s0, s0 + n)] * 2)
        out = run(ids, pos, [Segment(0, s0, n), Segment(1, s0, n)])
        outs[0].append(out[:n])
        outs[1].append(out[n:])
    for slot, ids in ((0, a), (1, b)):
        ref = model.compute_logits(model(ids, torch.arange(L), [Segment(0, 0, L)], model.make_cache(1, L)))
        torch.testing.assert_close(torch.cat(outs[slot]), ref, atol=1e-4, rtol=1e-4)

    # Slot 0's C128 entries sit in the rows of its own pages, and nowhere else.
    hca = model.cfg.compress_ratios.index(128)
    e = cache.layers[hca].entries["compressor"]
    own = {int(table[0, j * 128]) // 128 for j in range(L // 128)}
    other = {int(table[1, j * 128]) // 128 for j in range(L // 128)}
    for row in range(e.shape[0]):
        assert torch.isfinite(e[row]).all() == (row in own | other)
    assert not own & other
