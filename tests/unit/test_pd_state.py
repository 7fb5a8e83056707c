"""What PD disaggregation sends of a request is all of its state: copying exactly the bytes our pool
describes to SGLang's transfer layer (paged stores by page index, request rows by request slot),
the way its NIXL / Mooncake senders copy them, into another pool with other pages and another
slot, lets the decode side continue with the same logits as the side that prefilled; dropping any
piece is caught. The layout string both sides compare at bootstrap tells peers apart that could
not exchange state. The served path (NIXL over UCX, SGLang's router) is tests/e2e/test_pd_serving.py."""

import ctypes

import numpy as np
import pytest
import torch

from sglang_dsv4_ascend.attention_backend.pool import DSV4TokenToKVPool, request_row_buf_infos
from sglang_dsv4_ascend.batch import Segment

PAGE = 128


def _pool(cfg, slots, pages, spec_slack=0):
    """A pool whose request slot s owns the token pages `pages[s]` (SGLang's req_to_token)."""
    ctx = PAGE * max(len(p) for p in pages.values())
    req_to_token = torch.zeros(slots, ctx + spec_slack, dtype=torch.int32)
    for s, ps in pages.items():
        req_to_token[s, : len(ps) * PAGE] = (torch.tensor(ps)[:, None] * PAGE + torch.arange(PAGE)).flatten()
    return DSV4TokenToKVPool(
        size=16 * PAGE,
        page_size=PAGE,
        dtype=torch.float32,
        cfg=cfg,
        req_to_token=req_to_token,
        spec_slack=spec_slack,
        device="cpu",
    )


def _send(src_infos, dst_infos, src_index, dst_index):
    """SGLang's sender: item k of buffer i moves from src ptr + src_index[k] * item to dst ptr +
    dst_index[k] * item, for every buffer, the item length being the source's."""
    assert len(src_infos[0]) == len(dst_infos[0])
    for sp, dp, item, dst_item in zip(src_infos[0], dst_infos[0], src_infos[2], dst_infos[2]):
        assert item == dst_item
        for a, b in zip(src_index, dst_index):
            ctypes.memmove(dp + b * item, sp + a * item, item)


def _decode(model, pool, slot, start, tokens):
    out = []
    for i, t in enumerate(tokens):
        h = model(torch.tensor([t]), torch.tensor([start + i]), [Segment(slot, start + i, 1)], pool.cache)
        out.append(model.compute_logits(h))
    return torch.cat(out)


@pytest.fixture(scope="module")
def prefilled(dsv4_model):
    """`src()`: a pool whose slot 1 (scattered pages) has just prefilled a 300-token prompt: past
    the window, many C4 blocks, two C128 boundaries and a C128 block left open."""
    model = dsv4_model("flash")
    L = 300
    ids = torch.randint(0, model.cfg.vocab_size, (L + 8,), generator=torch.Generator().manual_seed(3))

    def src():
        pool = _pool(model.cfg, 3, {1: [5, 2, 7]})
        model(ids[:L], torch.arange(L), [Segment(1, 0, L)], pool.cache)
        return pool

    reference = _decode(model, src(), 1, L, ids[L:].tolist())  # the prefill side decoding on its own
    return model, src, ids, L, reference


def _decode_side(model, src, ids, L, rows=None, stores=None):
    src = src()
    """Transfer slot 1's state as described (`rows`, `stores`: the description, or a broken one)
    into slot 0 of a pool with other pages, as a decode server allocates them, and decode there."""
    dst = _pool(model.cfg, 2, {0: [9, 3, 11]})
    for t in dst.cache.state_tensors().values():
        t.normal_(generator=torch.Generator().manual_seed(1))  # a previous tenant's bytes
    stores = stores or DSV4TokenToKVPool.get_contiguous_buf_infos
    rows = rows or DSV4TokenToKVPool.request_row_tensors
    n = -(-L // PAGE)  # every page holding a token, the last one partly
    _send(stores(src), stores(dst), [5, 2, 7][:n], [9, 3, 11][:n])
    _send(request_row_buf_infos(rows(src)), request_row_buf_infos(rows(dst)), [1], [0])
    return _decode(model, dst, 0, L, ids[L:].tolist())


def test_decode_side_continues_exactly_from_the_transferred_state(prefilled):
    model, src, ids, L, reference = prefilled
    got = _decode_side(model, src, ids, L)
    torch.testing.assert_close(got, reference, rtol=0, atol=0)


def test_a_transfer_that_drops_a_piece_is_caught(prefilled):
    model, src, ids, L, reference = prefilled

    def without(kind):  # request rows without the SWA rings (kind 0) or the compressor rows (kind 1)
        def rows(pool):
            swa = {st.swa.data_ptr() for st in pool.cache.layers}
            return [t for t in pool.request_row_tensors() if (t.data_ptr() in swa) == (kind == 1)]

        return rows

    for broken in (without(0), without(1)):
        got = _decode_side(model, src, ids, L, rows=broken)
        assert not torch.allclose(got, reference, atol=1e-3)

    def c128_dropped(pool):  # the paged stores without the C128 entries
        r128 = {st.entries["compressor"].data_ptr() for st in pool.cache.layers if st.ratio == 128}
        infos = pool.get_contiguous_buf_infos()
        keep = [i for i, p in enumerate(infos[0]) if p not in r128]
        return tuple([x[i] for i in keep] for x in infos)

    got = _decode_side(model, src, ids, L, stores=c128_dropped)
    assert not torch.allclose(got, reference, atol=1e-3)


def test_every_store_is_described_by_page_and_by_slot(dsv4_model):
    """The described bytes cover every state tensor exactly once; an item is one page of entries
    (page / ratio rows) or one request slot of a ring."""
    cfg = dsv4_model("flash").cfg
    pool = _pool(cfg, 3, {0: [1]})
    ptrs, lens, items = pool.get_contiguous_buf_infos()
    rptrs, rlens, ritems = request_row_buf_infos(pool.request_row_tensors())
    tensors = pool.cache.state_tensors()
    assert sorted(lens + rlens) == sorted(t.numel() * t.element_size() for t in tensors.values())
    assert sorted(ptrs + rptrs) == sorted(t.data_ptr() for t in tensors.values())
    for st in pool.cache.layers:
        for e in st.entries.values():
            assert items[ptrs.index(e.data_ptr())] == PAGE // st.ratio * e.shape[1] * 4
        assert ritems[rptrs.index(st.swa.data_ptr())] == st.swa.shape[1] * st.swa.shape[2] * 4


def test_layout_string_tells_apart_peers_that_cannot_exchange_state(dsv4_model, tiny_ckpt):
    flash, pro = dsv4_model("flash").cfg, dsv4_model("pro").cfg
    a = _pool(flash, 3, {0: [1]}).pd_layout()
    assert a == _pool(flash, 5, {0: [2, 3]}).pd_layout()  # slots and pool size are each side's own
    assert a != _pool(pro, 3, {0: [1]}).pd_layout()  # another checkpoint
    assert a != _pool(flash, 3, {0: [1]}, spec_slack=4).pd_layout()  # speculative rows (rings) differ
    draft = [torch.zeros(4, 16, 8)]
    assert a != _pool(flash, 3, {0: [1]}).pd_layout(draft)  # one side carries a draft's state
    assert "draft rows 1 tensors 512 B/slot" in _pool(flash, 3, {0: [1]}).pd_layout(draft)


@pytest.mark.parametrize("kind", ["nextn", "dspark"])
def test_the_drafts_state_moves_with_the_request_rows(tiny_checkpoint, kind):
    """A speculative draft resumes on the decode side from its request rows alone (NextN: its
    cache's rings and the last committed row's logits and streams; DSpark: every stage's context
    ring): it drafts the same tree as on the side that prefilled. Without them (the target's state
    moved, the draft's not) it drafts another."""
    import types

    from sglang_dsv4_ascend.models.dspark import load_dspark_from_dir
    from sglang_dsv4_ascend.models.nextn import load_nextn_from_dir
    from sglang_dsv4_ascend.models.weights import load_model_from_dir
    from sglang_dsv4_ascend.speculative.drafters import make_drafter
    from sglang_dsv4_ascend.speculative.engine import NextNEngine, SpecEngine

    ckpt = tiny_checkpoint("flash", kind)
    trunk = load_model_from_dir(ckpt)
    gen = torch.Generator().manual_seed(0)
    if kind == "nextn":
        model = types.SimpleNamespace(model=trunk, nextn=load_nextn_from_dir(ckpt, trunk.cfg), cfg=trunk.cfg)
        make = lambda: NextNEngine(model, trunk.make_cache(2, 200, 6), 2, 3, 6, make_drafter, gen)  # noqa: E731
    else:
        model = types.SimpleNamespace(model=trunk, dspark=load_dspark_from_dir(ckpt, trunk.cfg), cfg=trunk.cfg)
        make = lambda: SpecEngine(  # noqa: E731
            model, trunk.make_cache(2, 200, 6), make_drafter, gen, gamma=4, topk=1, num_steps=4, num_draft_tokens=5
        )
    L = 61  # past the draft's window
    ids = torch.randint(1, 1000, (L,), generator=torch.Generator().manual_seed(5))
    src = make()
    aux = {"layer_ids": getattr(src.drafter, "layer_ids", ())}
    seg = [Segment(1, 0, L)]
    bonus = int(trunk.compute_logits(trunk(ids, torch.arange(L), seg, src.cache, aux=aux)[-1:]).argmax())
    src.extend(seg, torch.cat([ids[1:], torch.tensor([bonus])]), aux, None, [(0, L - 1)])

    def decode_side(with_draft: bool):
        dst = make()
        for name, t in src.cache.state_tensors().items():  # the target's state (moved as tested above)
            dst.cache.state_tensors()[name].copy_(t)
        if with_draft:
            rows = lambda eng: request_row_buf_infos(eng.drafter.request_row_tensors())  # noqa: E731
            _send(rows(src), rows(dst), [1], [1])
        return first_tree(dst)

    def first_tree(eng):
        drafts = eng.drafter.draft([1], [L], [bonus])
        return getattr(drafts, "trees", drafts)[0]  # NextN returns its trees, DSpark a Drafts

    def tree(t):
        return t.tokens, t.parents

    want = tree(first_tree(src))
    assert tree(decode_side(with_draft=True)) == want
    assert tree(decode_side(with_draft=False)) != want


def test_bench_reads_the_state_bytes_from_the_layout_line(dsv4_model):
    """`bench pd` computes each request's bytes from the layout line the servers log: what it
    reads is what the pool describes."""
    from sglang_dsv4_ascend.bench.pd import layout_bytes

    pool = _pool(dsv4_model("flash").cfg, 3, {0: [1]})
    draft = [torch.zeros(4, 16, 8)]
    got = layout_bytes(f"[t] dsv4_ascend PD layout: {pool.pd_layout(draft)}\n")
    assert got == {
        "page": PAGE,
        "bytes_per_page": sum(pool.get_contiguous_buf_infos()[2]),
        "bytes_per_slot": sum(request_row_buf_infos(pool.request_row_tensors())[2]),
        "draft_bytes_per_slot": 16 * 8 * 4,
    }


def test_bench_reads_the_last_moved_count_the_agent_logs(caplog):
    """`bench pd`'s moved bytes are the last count the prefill side's agent logged, in the form
    the agent's progress thread logs it; before any, nothing moved."""
    import logging

    from sglang_dsv4_ascend.bench.pd import moved  # (the hook's parser, as bench pd calls it)
    from sglang_dsv4_ascend.integration.hooks import pd_nixl_host_memory as hook

    assert moved("[t] dsv4_ascend PD layout: ...\n") == (0, 0)
    with caplog.at_level(logging.INFO, logger="sglang_dsv4_ascend"):
        for count in ((3, 691008), (7, 1382016)):
            hook.logger.info(hook.MOVED_LOG, *count)
    assert moved(caplog.text) == (7, 1382016)


def test_nixl_agent_on_host_memory_says_dram_where_sglang_says_vram():
    from sglang_dsv4_ascend.integration.hooks.pd_nixl_host_memory import HostMemoryAgent

    calls = []

    class Agent:
        name = "a"

        def register_memory(self, addrs, mem_type, backends=()):
            calls.append((addrs, mem_type, backends))

    agent = HostMemoryAgent(Agent())
    descs = np.zeros((2, 3), dtype=np.uint64)  # a descriptor array must pass through untouched
    agent.register_memory(descs, "VRAM")
    agent.register_memory([(1, 2, 0, "")], mem_type="VRAM", backends=["UCX"])
    agent.register_memory([(1, 2, 0, "")], "DRAM")
    assert [c[1] for c in calls] == ["DRAM", "DRAM", "DRAM"] and calls[0][0] is descs and calls[1][2] == ["UCX"]
    assert agent.name == "a"


def test_nixl_agent_counts_each_finished_transfers_bytes_once():
    """SGLang posts a transfer and polls it until DONE, and may poll a finished one again: each
    transfer's bytes (NIXL's telemetry) count once, when it is first seen DONE, whether `transfer`
    or `check_xfer_state` says so; an unfinished or failed one counts nothing."""
    from types import SimpleNamespace as NS

    from sglang_dsv4_ascend.integration.hooks.pd_nixl_host_memory import HostMemoryAgent

    class Handle:
        def __init__(self, nbytes, states):
            self.nbytes, self.states = nbytes, list(states)

    class Agent:  # each call moves a handle to its next state; the last one stays
        def transfer(self, h, notif=b""):
            return self.check_xfer_state(h)

        def check_xfer_state(self, h):
            return h.states.pop(0) if len(h.states) > 1 else h.states[0]

        def get_xfer_telemetry(self, h):
            return NS(totalBytes=h.nbytes)

    agent = HostMemoryAgent(Agent())
    slow, quick, failed = Handle(100, ["PROC", "PROC", "DONE"]), Handle(7, ["DONE"]), Handle(5, ["PROC", "ERR"])
    for h in (slow, quick, failed):
        agent.transfer(h)
    for _ in range(4):
        for h in (slow, quick, failed):
            agent.check_xfer_state(h)
    assert (agent.moved_transfers, agent.moved_bytes) == (2, 107)


def test_a_timeout_names_the_peer_each_side_waited_for():
    """Hook pd_timeout_peer on SGLang's KV managers' tables (the e2e faults run it served): the
    prefill side names the decode peer that claimed the room, or that none did at its bootstrap
    server with the peers it knows; the decode side names the prefill peer the room bootstrapped
    from; a reason that is not a timeout passes through unchanged."""
    from types import SimpleNamespace as NS

    from sglang_dsv4_ascend.integration.hooks.pd_timeout_peer import name_peer

    def recorded(mgr, room, reason):
        out = {}
        name_peer(lambda self, r, why: out.setdefault(r, why), mgr, room, reason)
        return out[room]

    timeout = "Request 7 timed out after 8.0s in KVPoll.Bootstrapping"
    decode = NS(endpoint="10.0.0.2", dst_port=5001, agent_name="agent-d")
    prefill = NS(bootstrap_host="10.0.0.1", bootstrap_port=8998, transfer_infos={7: {"agent-d": decode}})
    prefill.decode_kv_args_table = {"agent-d": decode, "agent-e": NS(endpoint="10.0.0.3", dst_port=5002)}
    assert recorded(prefill, 7, timeout) == timeout + "; decode peer 10.0.0.2:5001 (agent agent-d)"
    assert recorded(prefill, 8, timeout) == (
        timeout + "; no decode peer claimed the room at this prefill server's bootstrap server "
        "10.0.0.1:8998 (decode peers registered: 10.0.0.2:5001, 10.0.0.3:5002)"
    )
    receiver = NS(addr_to_rooms_tracker={"10.0.0.1:8998": {7}, "10.0.0.9:8998": {9}})
    assert recorded(receiver, 7, timeout).endswith("; prefill peer at bootstrap address 10.0.0.1:8998")
    assert recorded(receiver, 8, timeout).endswith("; prefill peer unknown (never bootstrapped)")
    assert recorded(prefill, 7, "Aborted by AbortReq.") == "Aborted by AbortReq."
    assert "peer unavailable" in recorded(NS(transfer_infos=None), 7, timeout)  # never raises


def test_bench_cache_transfer_arithmetic_is_the_described_bytes(dsv4_model):
    """`bench cache`'s pd_transfer_bytes (V4-Flash / -Pro shapes on the meta device) is what the
    pool describes for a request of that length: its entry pages and one slot of every ring."""
    from sglang_dsv4_ascend.bench.cache import pd_transfer_bytes

    pool = _pool(dsv4_model("flash").cfg, 3, {0: [1, 2, 3]})
    per_page = sum(pool.get_contiguous_buf_infos()[2])
    per_slot = sum(request_row_buf_infos(pool.request_row_tensors())[2])
    for length in (1, 128, 129, 300):
        want = -(-length // PAGE) * per_page + per_slot
        assert pd_transfer_bytes(pool.cache, length, PAGE) == want
