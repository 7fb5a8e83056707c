"""DeepSeek-V4 split over ranks (distributed/): two processes over gloo, each holding its layout's
heads, groups, experts and shared-expert slice, run the same random schedule (prefill chunks
across C4 / C128 / window boundaries, decode, speculative verify with deferred partial writes) and
their logits equal the one-rank model's within fp32 tolerance, under TP 2 (MoE-TP 2) and TP 2 /
EP 2, batched and per-segment, with the embedding and head vocab-parallel. Every rank returns the
same bits (the head's logit columns are all-gathered after the last all-reduce). A rank that takes
its neighbour's wo_b columns, embedding rows or head rows is caught. Plus the layout arithmetic,
the startup checks that name the flags, and the speculative sync check's helpers."""

import dataclasses
import multiprocessing
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from test_batched_forward import _random_schedule, _run

from sglang_dsv4_ascend.distributed.layout import Layout, layout_problems
from sglang_dsv4_ascend.distributed.sharding import SKIP, shard
from sglang_dsv4_ascend.distributed.spec_sync import RankSync, first_difference

TOL = dict(atol=1e-4, rtol=1e-4)


def _load(ckpt, layout=None):
    """The float model, or the W8A8 one for a ModelSlim checkpoint."""
    from sglang_dsv4_ascend.models.weights import load_model_from_dir
    from sglang_dsv4_ascend.quantization.w8a8 import is_modelslim_checkpoint, load_w8a8_model_from_dir

    if is_modelslim_checkpoint(ckpt):
        return load_w8a8_model_from_dir(ckpt, dtype=torch.float32, layout=layout)
    return load_model_from_dir(ckpt, layout=layout)


def _collectives() -> dict:
    """The Layout's collectives over the whole gloo world (the TP group; without DP attention also
    the attention-TP group), as SGLang's group coordinators give them in a server."""

    def reduce(x):
        dist.all_reduce(x)
        return x

    def gather(x):  # concatenated along the last dimension in rank order
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, -1)

    return dict(reduce=reduce, attn_gather=gather)


def _rank_main(rank, world, init_file, ckpt, tp, ep, impl, seed, out_dir, broken):
    from sglang_dsv4_ascend.models import weights

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    layout = dataclasses.replace(Layout.for_flags(tp, ep, tp_rank=rank), **_collectives())
    if broken:  # this rank's part of tensors named `broken` comes from the other rank
        other = dataclasses.replace(layout, attn_tp_rank=1 - layout.attn_tp_rank)
        orig = weights.shard
        weights.shard = lambda n, t, lay, e, g: orig(n, t, other if n.endswith(broken) else lay, e, g)
    model = _load(ckpt, layout)
    # the vocabulary divides the attention-TP group: embedding and head are vocab-parallel
    assert model.embed.num_embeddings == model.head.weight.shape[0] == model.cfg.vocab_size // layout.attn_tp_size
    batches, ctx = _random_schedule(seed, model.cfg.vocab_size)
    logits = _run(model, model.make_cache(5, ctx, spec_slack=6), batches, impl)
    torch.save(logits, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _start_ranks(fn, args, nprocs: int) -> None:
    """mp.spawn(fn, args, nprocs), each rank forked from a forkserver that imported torch once per
    test process instead of started as a fresh interpreter: importing torch took each rank about
    2.5 s of CPU (10 s for a four-rank case on two cores), more than the rank's work. The forkserver
    runs no torch op (an OpenMP pool created before a fork is unusable in the child, as for
    tools/zygote.py); it keeps the environment it started with, and no test here changes it."""
    multiprocessing.set_forkserver_preload(["torch"])  # no effect once the forkserver runs
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def _on_ranks(tmp_path, ckpt, tp, ep, impl, seed, broken=False):
    init = tmp_path / f"init-{tp}-{ep}-{impl}-{seed}-{broken}"
    _start_ranks(_rank_main, (tp, str(init), ckpt, tp, ep, impl, seed, str(tmp_path), broken), tp)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(tp)]


# (4, 1): more ranks than the 2 output groups, so two ranks share each group; MoE-TP 4
@pytest.mark.parametrize(
    "tp,ep,impl,seed", [(2, 1, "batched", 1), (2, 2, "batched", 2), (2, 2, "segments", 3), (4, 1, "batched", 4)]
)
def test_ranks_equal_one(tmp_path, tiny_ckpt, dsv4_model, tp, ep, impl, seed):
    model = dsv4_model("flash")
    batches, ctx = _random_schedule(seed, model.cfg.vocab_size)
    want = _run(model, model.make_cache(5, ctx, spec_slack=6), batches, impl)
    ranks = _on_ranks(tmp_path, tiny_ckpt("flash"), tp, ep, impl, seed)
    for i, w in enumerate(want):
        assert all(torch.equal(r[i], ranks[0][i]) for r in ranks), f"forward {i}: the ranks' logits differ"
        torch.testing.assert_close(ranks[0][i], w, **TOL, msg=lambda m: f"forward {i}: {m}")


def _w8a8_rank_main(rank, world, init_file, ckpt, out_dir, broken=False):
    """Each W8A8 layer that the layout splits, on the same input as one rank: wq_b's rows and the
    MoE (this rank's experts, the replicated shared expert added once, reduced)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    model = _load(ckpt, dataclasses.replace(Layout.for_flags(world, world, tp_rank=rank), **_collectives()))
    if broken:  # every rank adds the replicated shared expert: counted world times
        for blk in model.layers:
            blk.ffn.shared_replicated = False
    g = torch.Generator().manual_seed(0)
    T, cfg = 300, model.cfg
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    y = torch.randn(T, cfg.hidden_size, generator=g)
    q_lat = torch.randn(T, cfg.q_lora_rank, generator=g)
    out = {}
    with torch.no_grad():
        for i, blk in enumerate(model.layers):
            out[f"{i}.wq_b"] = blk.attn.wq_b(q_lat)
            out[f"{i}.ffn"] = blk.ffn(y, ids)
    torch.save(out, os.path.join(out_dir, f"w8a8_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("scheme,broken", [("dynamic", False), ("static", False), ("dynamic", True)])
def test_w8a8_layers_on_two_ranks_equal_one(tmp_path, tiny_ckpt, scheme, broken):
    """W8A8 under --tp-size 2 --ep-size 2: the split layers give one rank's result on the same
    input (wq_b rows concatenated; the MoE within fp32 reduction order). Whole forwards are not
    compared: an fp32 all-reduce rounds differently from one matmul, and a 1e-6 change in an
    activation flips an int8 rounding now and then (as any perturbation of that size does on one
    rank), so W8A8 logits under TP are as correct as one rank's but not bit-equal to them."""
    from sglang_dsv4_ascend.data import prompt_path
    from sglang_dsv4_ascend.quantization.w8a8 import W8A8Linear, W8A8MoE
    from sglang_dsv4_ascend.tools.quantize_w8a8 import quantize_checkpoint

    q = str(tmp_path / f"w8a8_{scheme}")
    calib = prompt_path("gsm8k") if scheme == "static" else None
    quantize_checkpoint(tiny_ckpt("flash"), q, scheme, calib=calib, num_calib=4, progress=False)
    init = tmp_path / "init-w8a8"
    _start_ranks(_w8a8_rank_main, (2, str(init), q, str(tmp_path), broken), 2)
    ranks = [torch.load(tmp_path / f"w8a8_rank{r}.pt") for r in range(2)]
    model = _load(q)
    g = torch.Generator().manual_seed(0)
    T, cfg = 300, model.cfg
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g)
    y = torch.randn(T, cfg.hidden_size, generator=g)
    q_lat = torch.randn(T, cfg.q_lora_rank, generator=g)
    with torch.no_grad():
        for i, blk in enumerate(model.layers):
            assert isinstance(blk.attn.wq_b, W8A8Linear) and isinstance(blk.ffn, W8A8MoE)
            torch.testing.assert_close(
                torch.cat([r[f"{i}.wq_b"] for r in ranks], -1), blk.attn.wq_b(q_lat), atol=0, rtol=0
            )
            want = blk.ffn(y, ids)
            assert torch.equal(ranks[0][f"{i}.ffn"], ranks[1][f"{i}.ffn"])
            if broken:
                assert float((ranks[0][f"{i}.ffn"] - want).abs().max()) > 1e-3
            else:
                torch.testing.assert_close(ranks[0][f"{i}.ffn"], want, atol=1e-5, rtol=1e-5)


def test_w8a8_refuses_a_split_expert(tmp_path, tiny_ckpt):
    from sglang_dsv4_ascend.quantization.w8a8 import W8A8Error
    from sglang_dsv4_ascend.tools.quantize_w8a8 import quantize_checkpoint

    q = str(tmp_path / "w8a8")
    quantize_checkpoint(tiny_ckpt("flash"), q, "dynamic", num_calib=2, progress=False)
    with pytest.raises(W8A8Error, match="--ep-size 2"):
        _load(q, Layout.for_flags(2, 1, tp_rank=0))


@pytest.mark.parametrize("broken", ["wo_b.weight", "embed.weight", "head.weight"])
def test_a_neighbours_part_is_caught(tmp_path, tiny_ckpt, dsv4_model, broken):
    """A rank holding its neighbour's wo_b columns (the partial sums no longer add up), vocabulary
    rows of the embedding (its tokens' rows wrong) or of the head (its logit columns wrong)."""
    model = dsv4_model("flash")
    batches, ctx = _random_schedule(1, model.cfg.vocab_size)
    want = _run(model, model.make_cache(5, ctx, spec_slack=6), batches, "batched")
    r0, _ = _on_ranks(tmp_path, tiny_ckpt("flash"), 2, 1, "batched", 1, broken=broken)
    assert max(float((a - w).abs().max()) for a, w in zip(r0, want)) > 1e-2


def test_shards_cover_each_tensor_once(dsv4_model):
    """Over the ranks of a layout, the split tensors tile the released ones and each expert lives on
    exactly one EP rank (checked by reassembling them)."""
    model = dsv4_model("flash")
    sd = {k: v for k, v in model.state_dict().items()}
    E = model.cfg.n_routed_experts
    G = model.cfg.o_groups
    for tp, ep in [(2, 1), (2, 2), (4, 1), (4, 4)]:
        parts = [
            {n: shard(n, t, Layout.for_flags(tp, ep, tp_rank=r), E, model.cfg.o_groups) for n, t in sd.items()}
            for r in range(tp)
        ]
        owners = {n: [r for r in range(tp) if parts[r][n] is not SKIP] for n in sd}
        for n, t in sd.items():
            got = [parts[r][n] for r in owners[n]]
            if ".experts." in n:
                moe_tp = tp // ep
                assert len(got) == moe_tp, n
            if all(g is t for g in got):
                continue  # replicated
            if n.endswith("wo_b.weight") and tp > G:  # ranks sharing a group hold its columns each
                got = got[:: tp // G]
            if n.endswith("wo_a.weight") and tp > G:  # a group's rows, its heads' columns split
                s = tp // G
                got = [torch.cat(got[g * s : (g + 1) * s], 1) for g in range(G)]
            dim = 1 if n.endswith(("wo_b.weight", "w2.weight")) else 0
            torch.testing.assert_close(torch.cat(got, dim), t, msg=n)


def test_gathered_head_rounds_as_sglangs_plain_head():
    """The head SGLang's LogitsProcessor gets under vocab parallelism: rank 0's columns, gathered
    with rank 1's, are what the processor computes for a whole plain head (a matmul in the weight's
    dtype; in fp32 for fp32 hidden states), bit for bit and in the same dtype: a bf16 head is not
    copied to fp32 (as compute_logits does for the speculative engine) on every served forward."""
    from sglang_dsv4_ascend.layers.vocab_parallel import GatheredHead

    g = torch.Generator().manual_seed(0)
    V, d = 64, 256
    w = torch.randn(V, d, generator=g).bfloat16()
    h = torch.randn(5, d, generator=g)

    def plain(hidden):  # LogitsProcessor._compute_lm_head for an unquantized head of weight w
        return (
            torch.matmul(hidden.float(), w.float().T)
            if hidden.dtype == torch.float32
            else torch.matmul(hidden.to(w.dtype), w.T)
        )

    for hidden in (h.bfloat16(), h):
        rank1 = plain(hidden)[:, V // 2 :]  # what rank 1 contributes to the gather
        layout = dataclasses.replace(Layout.for_flags(2, tp_rank=0), attn_gather=lambda x: torch.cat([x, rank1], -1))
        part = torch.nn.Linear(d, V // 2, bias=False).bfloat16()
        with torch.no_grad():
            part.weight.copy_(w[: V // 2])
        head = GatheredHead(part, layout)
        got = head.quant_method.apply(head, hidden)
        want = plain(hidden)
        assert got.dtype == want.dtype and torch.equal(got, want), hidden.dtype


def test_layout_coordinates_follow_sglang():
    # tp 4, ep 2: MoE-TP 2; ranks 0,1 hold the first half of the experts.
    lays = [Layout.for_flags(4, 2, tp_rank=r) for r in range(4)]
    assert [(x.ep_rank, x.moe_tp_rank) for x in lays] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert lays[3].experts(8) == range(4, 8)
    assert Layout().all_reduce(t := torch.ones(2)) is t
    with pytest.raises(RuntimeError, match="no reduce function"):
        lays[0].all_reduce(torch.ones(2))


def test_layout_problems_name_the_flags(dsv4_model):
    cfg = dsv4_model("flash").cfg  # 4 heads, 2 output groups, 8 experts, inter 32
    assert layout_problems(cfg, 2, 1) == [] and layout_problems(cfg, 2, 2) == []
    assert layout_problems(cfg, 4, 1) == []  # two ranks per output group
    msg = layout_problems(cfg, 3, 1)[0]
    assert msg.startswith("--tp-size 3") and "o_groups 2" in msg and "[1, 2, 4]" in msg
    msgs = layout_problems(dataclasses.replace(cfg, num_attention_heads=6, o_groups=6), 6, 3)
    assert any(m.startswith("--ep-size 3") and "8 routed experts" in m for m in msgs), msgs
    assert any(m.startswith("--ep-size 3") for m in layout_problems(cfg, 2, 3))
    assert layout_problems(cfg, 2, 1, dp_size=2) == []  # plain --dp-size: replicas of the TP layout
    assert layout_problems(cfg, 4, 2, dp_size=2, enable_dp_attention=True) == []  # attention TP 2
    msg = layout_problems(cfg, 2, 1, dp_size=4, enable_dp_attention=True)[0]
    assert msg.startswith("--dp-size 4 --enable-dp-attention (--attn-dp-size 4)") and "[2]" in msg
    cfg6 = dataclasses.replace(cfg, num_attention_heads=6, o_groups=6)  # attention TP 4 does not fit 6 heads
    msg = layout_problems(cfg6, 8, 1, dp_size=2, enable_dp_attention=True)[0]
    assert msg.startswith("--tp-size 8 / --dp-size 2 (attention TP 4)") and "[1, 2, 3, 6]" in msg


def test_rank_sync_helpers(monkeypatch):
    same = {"accept_lens": [2, 1], "paths": [[0, 1], [0]]}
    assert first_difference([same, dict(same)]) is None
    assert first_difference([same, {**same, "accept_lens": [2, 2]}]) == ("accept_lens", 0, 1)
    monkeypatch.setenv("SGLANG_DSV4_DEBUG_DESYNC_RANK", "1")
    assert RankSync(rank=1, size=2).seed(7) == 8 and RankSync(rank=0, size=2).seed(7) == 7
    one = RankSync()
    assert one.any(True) and not one.any(False) and one.broadcast("x") == "x"
    one.check({"a": 1})  # one rank: nothing to compare


def test_doctor_ranks_reports_each_rank_or_the_flag(capsys):
    from sglang_dsv4_ascend.tools import doctor

    assert doctor.main(["--ranks", "2", "--ep-size", "2", "--json"]) == 0
    import json

    r = json.loads(capsys.readouterr().out)
    assert [x["experts"] for x in r["ranks"]] == [[0, 4], [4, 8]] and [x["heads"] for x in r["ranks"]] == [
        [0, 2],
        [2, 4],
    ]
    assert doctor.main(["--ranks", "3"]) == 1
    assert "PROBLEM: --tp-size 3" in capsys.readouterr().out
    # DP attention: attention TP 2 per DP group (heads split 2 ways, repeated per group), experts 4 ways
    assert doctor.main(["--ranks", "4", "--ep-size", "4", "--dp-size", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["flags"].endswith("--dp-size 2 --enable-dp-attention")
    assert [x["heads"] for x in r["ranks"]] == [[0, 2], [2, 4], [0, 2], [2, 4]]
    assert [x["experts"] for x in r["ranks"]] == [[0, 2], [2, 4], [4, 6], [6, 8]]
    V = r["ranks"][1]["vocab"][1]  # vocabulary rows halved over each DP group's attention TP
    assert [x["vocab"] for x in r["ranks"]] == [[0, V // 2], [V // 2, V]] * 2
    assert "dp 1/2" in r["ranks"][3]["describe"]
    assert doctor.main(["--ranks", "2", "--dp-size", "4"]) == 1
    assert "PROBLEM: --dp-size 4 --enable-dp-attention" in capsys.readouterr().out


def test_bench_cache_per_rank_share(monkeypatch):
    from sglang_dsv4_ascend.bench.cache import CONFIGS, per_rank
    from sglang_dsv4_ascend.config import DSV4Config
    from sglang_dsv4_ascend.models.trunk import DSV4Model

    # Every model here is on the meta device, where parameters hold no values: the random init of
    # Flash's 33k linears (a Python decomposition each on meta) was half of each model's build.
    monkeypatch.setattr(torch.nn.Linear, "reset_parameters", lambda self: None)
    monkeypatch.setattr(torch.nn.Embedding, "reset_parameters", lambda self: None)
    whole = DSV4Model(DSV4Config.from_hf(CONFIGS["flash"]), dtype=torch.bfloat16, device="meta")
    total = sum(p.numel() * p.element_size() for p in whole.parameters()) + sum(
        b.numel() * b.element_size() for b in whole.buffers()
    )
    one = per_rank("flash", 1, 1, torch.bfloat16)
    assert one["weights_gb"]["float"] == round(total / 1e9, 2)
    assert one["sent_bytes_per_decode_token"]["attention_all_reduce"] == 0
    r16 = per_rank("flash", 16, 16, torch.bfloat16)
    assert r16["experts_per_rank"] == 16 and r16["heads_per_rank"] == 4
    # experts, heads and vocabulary rows split 16 ways; router, KV path replicated
    assert total / 16 < r16["weights_gb"]["float"] * 1e9 < total / 4
    assert r16["vocab_rows_per_rank"] == 129280 // 16 and one["vocab_rows_per_rank"] == 129280
    sent16 = r16["sent_bytes_per_decode_token"]
    assert sent16["logits_all_gather_fp32"] == round(15 / 16 * 129280 * 4) and sent16["embedding_all_reduce"] > 0
    assert r16["cache_bytes_per_token"] == one["cache_bytes_per_token"]  # one shared KV head: replicated
    with pytest.raises(ValueError, match="--ep-size 3"):
        per_rank("flash", 16, 3, torch.bfloat16)
    # DP attention 16 x attention TP 1: every rank holds all heads (attention weights replicated,
    # no attention all-reduce), experts still 16 ways; the MoE input of all 16 DP ranks is exchanged
    d16 = per_rank("flash", 16, 16, torch.bfloat16, dp=16)
    assert (d16["attn_tp"], d16["heads_per_rank"], d16["experts_per_rank"]) == (1, 64, 16)
    assert d16["weights_gb"]["float"] > r16["weights_gb"]["float"]
    assert d16["vocab_rows_per_rank"] == 129280  # attention TP 1: the vocabulary whole on every rank
    assert d16["sent_bytes_per_decode_token"]["logits_all_gather_fp32"] == 0
    sent = d16["sent_bytes_per_decode_token"]
    assert sent["attention_all_reduce"] == 0 and sent["dp_gather_all_reduce"] > 0
    assert sent["moe_all_reduce_fp32"] == 16 * r16["sent_bytes_per_decode_token"]["moe_all_reduce_fp32"]
    with pytest.raises(ValueError, match="--dp-size 3"):
        per_rank("flash", 16, 16, torch.bfloat16, dp=3)


def test_each_rank_reads_only_its_part(tiny_ckpt, dsv4_model):
    """iter_checkpoint(part=rank_part(...)) reads split tensors by slice and never another rank's experts; the model it
    loads equals the one loaded from whole tensors."""
    from sglang_dsv4_ascend.distributed.sharding import rank_part
    from sglang_dsv4_ascend.models.trunk import DSV4Model
    from sglang_dsv4_ascend.models.weights import iter_checkpoint, load_released_weights

    path, cfg = tiny_ckpt("flash"), dsv4_model("flash").cfg
    whole = sum(t.numel() for _, t, _ in iter_checkpoint(path))
    for tp, ep in [(2, 2), (4, 1)]:
        lay = Layout.for_flags(tp, ep, tp_rank=1)
        parts = list(iter_checkpoint(path, part=rank_part(lay, cfg.n_routed_experts, cfg.o_groups)))
        assert not any(".experts.0." in n for n, _, _ in parts) or ep == 1
        assert sum(t.numel() for _, t, _ in parts) < whole * 0.8
        a, b = DSV4Model(cfg, layout=lay), DSV4Model(cfg, layout=lay)
        load_released_weights(a, parts, presliced=True)
        load_released_weights(b, iter_checkpoint(path))
        for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), n


def _dp_schedules(vocab, seeds=(11, 12), steps=(9, 6), pad_seed=5):
    """Each DP rank's own schedule (different requests, lengths, and number of busy forwards: the
    shorter one idles at the end, as an SGLang DP rank with nothing to run still joins every
    forward) and, per forward, SGLang-style counts: real rows plus a few padding rows."""
    import random

    scheds = [_random_schedule(s, vocab, steps=n) for s, n in zip(seeds, steps)]
    rng = random.Random(pad_seed)
    counts = []
    for i in range(max(steps)):
        real = [sum(x.length for x in b[i][0]) if i < len(b) else 0 for b, _ in scheds]
        counts.append([r + rng.choice([0, 0, 1, 3]) for r in real])
    return scheds, counts


def _dp_rank_main(rank, world, init_file, ckpt, ep, out_dir, broken, explicit):
    """`explicit`: the test's own counts with padding rows passed to every forward; else the
    model builds each forward's exchange from the layout's host all-gather of row counts (what
    a server does)."""
    from types import SimpleNamespace

    from sglang_dsv4_ascend.distributed.dp_exchange import DPExchange
    from sglang_dsv4_ascend.distributed.layout import _counts_over

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)

    layout = dataclasses.replace(
        Layout.for_flags(world, ep, dp_size=world, tp_rank=rank),
        **_collectives(),
        gather_counts=_counts_over(SimpleNamespace(world_size=world, cpu_group=None), 1),
    )
    assert (layout.attn_tp_size, layout.dp_rank) == (1, rank)
    if broken:  # the token ids are never exchanged: other DP ranks' rows are hash-routed by ours
        DPExchange.bind = lambda self, ids: (
            setattr(
                self,
                "ids",
                torch.cat(
                    [ids.new_zeros(self.offset), ids[: self.real], ids.new_zeros(self.total - self.offset - self.real)]
                ),
            )
            or self
        )
    model = _load(ckpt, layout)
    (scheds, counts) = _dp_schedules(model.cfg.vocab_size)
    batches, ctx = scheds[rank]
    cache = model.make_cache(5, ctx, spec_slack=6)
    outs = []
    with torch.no_grad():
        for i, cnt in enumerate(counts):
            segs, ids, accepted = batches[i] if i < len(batches) else ([], torch.zeros(0, dtype=torch.long), None)
            pos = torch.cat([torch.arange(s.start, s.start + s.length) for s in segs]) if segs else ids.clone()
            ex = (
                DPExchange(cnt, layout.dp_rank, ids.shape[0], layout.attn_tp_rank == 0, layout.all_reduce)
                if explicit
                else None
            )
            pending = [] if accepted is not None else None
            outs.append(model.compute_logits(model(ids, pos, segs, cache, pending=pending, exchange=ex)))
            if pending is not None:
                cache.apply(pending, accepted)
    torch.save(outs, os.path.join(out_dir, f"dp_rank{rank}.pt"))
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.parametrize("ep,broken,explicit", [(1, False, True), (2, False, True), (2, True, True), (2, False, False)])
def test_dp_attention_ranks_equal_one(tmp_path, tiny_ckpt, dsv4_model, ep, broken, explicit):
    """--tp-size 2 --dp-size 2 --enable-dp-attention (attention TP 1): each DP rank serves its own
    schedule from its own cache, with padding rows and an idle rank in the counts, while every MoE
    runs over both ranks' tokens (split by MoE-TP, or by EP); each rank's logits equal the
    one-rank model on that rank's schedule alone. Without the token-id exchange the hash-routed
    layers route the other rank's rows wrongly, and that is caught."""
    model = dsv4_model("flash")
    assert model.cfg.num_hash_layers > 0  # the broken variant needs hash-routed layers to bite
    scheds, counts = _dp_schedules(model.cfg.vocab_size)
    assert len(scheds[1][0]) < len(counts)  # rank 1 idles at the end
    assert any(
        c[r] > sum(x.length for x in scheds[r][0][i][0])
        for r in range(2)
        for i, c in enumerate(counts)
        if i < len(scheds[r][0])
    )  # and padding rows occur
    init = tmp_path / f"init-dp-{ep}-{broken}-{explicit}"
    _start_ranks(_dp_rank_main, (2, str(init), tiny_ckpt("flash"), ep, str(tmp_path), broken, explicit), 2)
    mismatches = 0
    for r in range(2):
        got = torch.load(tmp_path / f"dp_rank{r}.pt")
        batches, ctx = scheds[r]
        want = _run(model, model.make_cache(5, ctx, spec_slack=6), batches, "batched")
        assert all(g.shape[0] == 0 for g in got[len(want) :])  # the idle forwards return no rows
        for i, w in enumerate(want):
            if broken:
                mismatches += not torch.allclose(got[i], w, **TOL)
            else:
                torch.testing.assert_close(got[i], w, **TOL, msg=lambda m: f"DP rank {r}, forward {i}: {m}")
    if broken:
        assert mismatches > 0, "the broken exchange (ids not gathered) went unnoticed"


def test_dp_exchange_offsets_and_checks():
    from sglang_dsv4_ascend.distributed.dp_exchange import DPExchange

    # two DP ranks simulated in one process: reduce = sum of both ranks' buffers
    rows = [torch.arange(6.0).reshape(3, 2), torch.arange(10.0, 14.0).reshape(2, 2)]
    counts = [4, 2]  # rank 0 has one padding row
    bufs = []
    exs = [DPExchange(counts, r, rows[r].shape[0], True, lambda b: bufs.append(b) or b) for r in range(2)]
    parts = [ex.gather(x) for ex, x in zip(exs, rows)]
    total = parts[0] + parts[1]
    assert total.shape == (6, 2) and torch.equal(total[:3], rows[0]) and torch.equal(total[3], torch.zeros(2))
    assert torch.equal(total[4:], rows[1])
    assert [torch.equal(ex.scatter(total), x) for ex, x in zip(exs, rows)] == [True, True]
    # a non-writer (attention-TP rank > 0) contributes zeros: each row counted once
    assert not DPExchange(counts, 0, 3, False, lambda b: b).gather(rows[0]).any()
    with pytest.raises(ValueError, match="dp_rank 2"):
        DPExchange(counts, 2, 0, True, lambda b: b)
    with pytest.raises(ValueError, match="3 real rows on DP rank 1"):
        DPExchange(counts, 1, 3, True, lambda b: b)


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_each_w8a8_rank_reads_only_its_part(tmp_path, tiny_ckpt, scheme):
    """A ModelSlim checkpoint under --tp-size 2 --ep-size 2 (DP attention or not): each rank reads
    its wq_b rows with their scales and its own experts by slice, never another rank's experts,
    and the model it loads equals the one cut from whole tensors."""
    from sglang_dsv4_ascend.data import prompt_path
    from sglang_dsv4_ascend.models.trunk import DSV4Model
    from sglang_dsv4_ascend.models.weights import iter_checkpoint
    from sglang_dsv4_ascend.quantization.w8a8 import (
        apply_quant_description,
        load_w8a8_weights,
        read_quant_description,
        w8a8_rank_part,
    )
    from sglang_dsv4_ascend.tools.quantize_w8a8 import quantize_checkpoint

    q = str(tmp_path / scheme)
    quantize_checkpoint(
        tiny_ckpt("flash"),
        q,
        scheme,
        calib=prompt_path("gsm8k") if scheme == "static" else None,
        num_calib=4,
        progress=False,
    )
    desc = read_quant_description(q)
    tensors = [(n, t.numel()) for n, t, _ in iter_checkpoint(q)]
    whole = sum(k for _, k in tensors)
    cfg = _load(tiny_ckpt("flash")).cfg
    # rank 1 of EP 2 holds experts 4..7: the other half is never read
    others = sum(k for n, k in tensors if re.match(r"layers\.\d+\.ffn\.experts\.[0-3]\.", n))
    assert others > 0
    for dp in (1, 2):
        lay = Layout.for_flags(2, 2, dp, tp_rank=1)

        def fresh():
            m = DSV4Model(cfg, dtype=torch.float32, layout=lay)
            apply_quant_description(m, desc)
            return m

        a, b = fresh(), fresh()
        parts = list(iter_checkpoint(q, part=w8a8_rank_part(a)))
        assert not any(".experts.0." in n for n, _, _ in parts)
        assert sum(t.numel() for _, t, _ in parts) <= whole - others
        load_w8a8_weights(a, parts, desc, presliced=True)
        load_w8a8_weights(b, iter_checkpoint(q), desc)
        sa, sb = a.state_dict(), b.state_dict()
        assert sa.keys() == sb.keys()
        for n in sa:
            assert torch.equal(sa[n], sb[n]), n
