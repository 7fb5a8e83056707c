"""The speculative round's target verify captured per row bucket (speculative/graphs.py): rounds
with the captured verify emit what eager rounds emit and what plain greedy decoding emits, and leave
every request's cache state equal to the eager engine's, for NextN chain, NextN tree, DSpark
static and DSpark with ragged (adaptive-like) verify lengths, while requests join and leave and
the round moves between buckets. Acceptance is driven on purpose by the replay drafter: each
request full, partial or zero per round.

torch.compile with dynamo's "eager" compiler: its tracing and guards (each bucket traced once at
capture; dynamo raises on any recompile after it), the traced graph run as it is. One captured
verify (buckets of 5 and 20 rows, segments up to 5 tokens) serves every method in turn on one
cache, as one server's would serve its rounds: a trace costs ~8 s here. The oracle is the
engine's eager verify on a fresh cache, and plain decoding (tests/oracles/decode.py)."""

import json
import re
import types

import pytest
import torch
from oracles.decode import dspark_engine, plain_greedy, prefill

from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.kvcache import plan as kv_plan
from sglang_dsv4_ascend.speculative.cost import RoundCost
from sglang_dsv4_ascend.speculative.drafters import ReplayDrafter
from sglang_dsv4_ascend.speculative.engine import SpecEngine
from sglang_dsv4_ascend.speculative.graphs import VerifyGraphs
from sglang_dsv4_ascend.speculative.planner import Planner, measure_cost

# One worker runs the module: its captured verify (~18 s of tracing) would otherwise be traced
# again on the other xdist worker.
pytestmark = pytest.mark.xdist_group("spec_graphs")
N_NEW = 20
PROMPTS = {1: 125, 2: 61, 3: 7, 4: 250}  # slot -> prompt length: C4 and C128 boundaries crossed
MODES = {1: "full", 2: "partial:1", 3: "zero", 4: "cycle"}
# requests joining and leaving round by round (several buckets of rows)
LIVE = [[1, 2, 3, 4], [2, 4], [1], [3, 1, 2], [4], [1, 2, 3, 4], [2, 3]]
METHODS = {  # (topk, steps, draft tokens, DSpark gamma or None, ragged verify lengths)
    "nextn_chain": (1, 3, 4, None, False),
    "nextn_tree": (2, 3, 6, None, False),
    "dspark_static": (1, 4, 5, 4, False),
    "dspark_ragged": (1, 4, 5, 4, True),
    "dspark_adaptive": (1, 4, 5, 4, "adaptive"),
}
# the adaptive planner's surface: 10 ms a round plus 4 ms a verified row (fixed: not refined online)
COST = RoundCost(0.01, [1, 16], [0.0, 0.0], [1, 80], [0.0, 0.004 * 79])


class Ragged:
    """A planner that cuts each chain to a length fixed by the round number and the request alone
    (information fixed before the round's draws, as the adaptive planner's): 0..gamma drafts."""

    def __init__(self, gamma):
        self.gamma, self.k, self.last = gamma, 0, {}

    def decide(self, slots, gens):
        return None

    def plan(self, slots, gens, confidence, decision):
        self.k += 1
        return [(self.k + s) % (self.gamma + 1) for s in slots]

    def learn(self, accepted):
        pass

    def observe(self, *a):
        pass


def _prompts():
    g = torch.Generator().manual_seed(7)
    return {s: torch.randint(1, 1000, (n,), generator=g).tolist() for s, n in PROMPTS.items()}


@pytest.fixture(scope="module")
def setup(dsv4_model, tmp_path_factory):
    model = dsv4_model("flash")
    prompts = _prompts()
    slots = sorted(prompts)
    want = dict(zip(slots, plain_greedy(model, [prompts[s] for s in slots], N_NEW)))
    path = tmp_path_factory.mktemp("replay") / "replay.json"
    path.write_text(
        json.dumps({"sequences": [prompts[s] + want[s] for s in slots], "modes": [MODES[s] for s in slots]})
    )
    return model, prompts, want, str(path)


WIDTH, ROWS = 5, (5, 20)  # the captured verify: segments up to 5 tokens, 5 or 20 rows
# and requests up to 256 committed tokens (SGLANG_DSV4_GRAPH_CONTEXT): slot 4's rounds run eager
# once its 250-token prompt has grown past it
CONTEXT = 256


def _cache(model):
    """Slots 1..4 for the requests, 6 speculative rows (the widest round's segment is 5)."""
    return model.make_cache(max(PROMPTS) + 1, 512, 6)


def _engine(model, method, replay_path, cache=None):
    topk, steps, n_draft, gamma, ragged = METHODS[method]
    cache = cache if cache is not None else _cache(model)
    shape = dict(topk=topk, num_steps=steps, num_draft_tokens=n_draft)
    if gamma is not None:
        shape["gamma"] = gamma
    planner = Ragged(gamma) if ragged is True else None
    if ragged == "adaptive":
        planner = Planner(gamma, "adaptive")
        planner.use(COST, online=False)
    host = types.SimpleNamespace(model=model, cfg=model.cfg)
    return SpecEngine(
        host, cache, lambda e: ReplayDrafter(e, replay_path), torch.Generator().manual_seed(0), planner=planner, **shape
    )


@pytest.fixture(scope="module")
def captured(setup):
    """(cache, VerifyGraphs) shared by the module's tests; traced once."""
    from torch._dynamo.utils import counters

    from sglang_dsv4_ascend.ops import scripted

    model = setup[0]
    torch._dynamo.reset()
    cache = _cache(model)
    compile_fn = lambda f: torch.compile(f, dynamic=False, backend="eager")  # noqa: E731
    graphs = VerifyGraphs(model, cache, WIDTH, ROWS, compile_fn=compile_fn, context=CONTEXT)
    # As in a server, whose first forward is the capture: nothing built lazily yet (the
    # TorchScript mHC of ops/scripted.py scripted inside the trace, the MoE's expert stacks built
    # there: each broke the graph and left the served "captured" verify running mostly eager).
    # One graph per bucket, no break.
    lazily, scripted._compiled = dict(scripted._compiled), {}
    for m in model.modules():  # the MoE's expert stacks, built on a first forward
        if hasattr(m, "_stacked"):
            m._stacked = None
    counters.clear()
    graphs.capture(log=lambda msg: None)
    scripted._compiled.update(lazily)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == len(ROWS), dict(counters["stats"])
    yield cache, graphs
    torch._dynamo.reset()


def _serve(model, method, prompts, replay_path, captured=None):
    """Prefill every request, then rounds over LIVE until each has N_NEW tokens -> (tokens per
    slot, engine, rounds that replayed the captured verify, rounds in all). `eng.reach` lists each
    round's (longest committed length, whether it replayed)."""
    cache, graphs = captured if captured is not None else (None, None)
    eng = _engine(model, method, replay_path, cache)
    eng.graphs, eng.plans, eng.reach = graphs, [], []
    if graphs is not None and isinstance(eng.planner, Planner):
        eng.planner.pad = graphs.rows_for  # as the worker prices a captured verify
    replays = graphs.replays if graphs is not None else 0
    got, lens = {}, {}
    for s, p in prompts.items():
        eng.cache.reset_slot(s)  # the shared cache held another method's requests
        h = model(torch.tensor(p), torch.arange(len(p)), [Segment(s, 0, len(p))], eng.cache)
        got[s], lens[s] = [int(model.compute_logits(h[-1:]).argmax(-1))], len(p)
        eng.extend([Segment(s, 0, len(p))], torch.tensor(p[1:] + got[s]), {}, None, [])
    step = 0
    while min(len(g) for g in got.values()) < N_NEW:
        live = [s for s in LIVE[step % len(LIVE)] if len(got[s]) < N_NEW] or [s for s in got if len(got[s]) < N_NEW]
        step += 1
        hist = [prompts[s] + got[s] for s in live]
        before = graphs.replays if graphs is not None else 0
        r = eng.round(live, [lens[s] for s in live], [got[s][-1] for s in live], None, hist, live)
        eng.plans.append((len(live), r.plan))
        eng.reach.append((max(lens[s] for s in live), graphs is not None and graphs.replays > before))
        for s, e, a in zip(live, r.emitted, r.accept_lens):
            got[s] += e
            lens[s] += a
    replayed = (graphs.replays - replays) if graphs is not None else 0
    eng.lens = lens
    return {s: g[:N_NEW] for s, g in got.items()}, eng, replayed, step


def _state_gap(a, b) -> float:
    """The largest difference between two engines' target caches over what both committed: per
    request, the ring rows of positions both hold (a ring of n rows keeps the last n) and the
    entries both completed. The engines may stop a request at different lengths: a round commits
    up to its accepted drafts, and their planners may verify different drafts."""
    worst = 0.0
    for slot, la in a.lens.items():
        lo_end, hi_end = sorted((la, b.lens[slot]))
        sa, sb = a.cache.slot_state(slot), b.cache.slot_state(slot)
        for k, v in sa.items():
            if k.endswith(".entries"):
                rows = list(range(lo_end // a.cache.layers[int(k.split(".")[1])].ratio))
            else:
                rows = [p % v.shape[0] for p in range(max(0, hi_end - v.shape[0]), lo_end)]
            if rows:
                worst = max(worst, (v[rows] - sb[k][rows]).abs().max().item())
    return worst


@pytest.mark.parametrize("method", list(METHODS))
def test_captured_verify_equals_eager_and_plain_decoding(setup, captured, method, monkeypatch):
    """A round with a request past the buckets' context runs eager, and so does a NextN tree
    round of more than one request (up to 40 rows: no bucket holds it); every other round
    replays, and rounds move between the two on one cache."""
    model, prompts, want, replay = setup
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)  # every bucket traced at capture
    eager, eager_eng, _, _ = _serve(model, method, prompts, replay)
    got, eng, replayed, rounds = _serve(model, method, prompts, replay, captured)
    assert eager == want and got == want
    assert 0 < replayed < rounds
    assert not any(done for reach, done in eng.reach if reach > CONTEXT)
    assert any(reach > CONTEXT for reach, _ in eng.reach)
    if method != "nextn_tree":
        assert all(done for reach, done in eng.reach if reach <= CONTEXT)
    assert _state_gap(eng, eager_eng) < 1e-4
    graphs = captured[1]
    assert set(graphs.buffers.plans) == set(graphs.buckets)  # one persistent plan per bucket
    if method == "dspark_ragged":  # ragged budgets: both buckets replayed
        assert graphs.replayed == set(graphs.buckets)


def test_the_adaptive_budget_fills_the_bucket(setup, captured, monkeypatch):
    """Under the captured verify a round runs at its bucket's rows, so the planner prices a budget
    there and fills the bucket: every round verifies a whole bucket (5 or 20 rows) or every draft
    it has. Priced at its own rows (the eager engine's planner, the broken variant here) the same
    surface leaves rows of the bucket padding: the replay drafter's zero-acceptance request says
    0.2 per draft, which pays for no draft at 4 ms a row, yet up to the 5-row bucket is free.
    A round with a request past the buckets' context runs eager and is priced at its own rows."""
    model, prompts, want, replay = setup
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    eager, eager_eng, *_ = _serve(model, "dspark_adaptive", prompts, replay)
    got, eng, replayed, rounds = _serve(model, "dspark_adaptive", prompts, replay, captured)
    assert eager == want and got == want and replayed == sum(reach <= CONTEXT for reach, _ in eng.reach)

    def unfilled(plans):
        return [(R, p["rows"]) for R, p in plans if p["rows"] not in (5, 20, R * 5)]

    within = [p for p, (reach, _) in zip(eng.plans, eng.reach) if reach <= CONTEXT]
    past = [p for p, (reach, _) in zip(eng.plans, eng.reach) if reach > CONTEXT]
    assert not unfilled(within) and unfilled(eager_eng.plans)
    # a round past the buckets' context runs eager: priced at its own rows, as the eager engine's
    assert past and unfilled(past)


def test_the_seed_is_measured_at_the_rows_rounds_run_at(captured, monkeypatch):
    """The startup cost seed times the verify as rounds run it (the captured bucket) and records
    each point at its bucket's rows, where the planner prices budgets."""
    cache, graphs = captured
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    before = graphs.replays
    cost = measure_cost(graphs.trunk, cache, 4, max_requests=4, budget_s=0.0, graphs=graphs)
    assert {(R, m) for R, m, _ in cost.points} == {(1, 5), (4, 5), (4, 20)}
    assert graphs.replays - before == 3 * len(cost.points)  # one warm-up, best of two


def _saved(store) -> dict:
    """(key, boundary) -> every layer's saved window and open compressor rows."""
    out = {}
    for idx, key in enumerate(store._key):
        if key >= 0:
            rows = [t[idx] for layer in store.rows for pair in layer.values() for t in pair]
            out[key, store._boundary[idx]] = [t[idx] for t in store.swa] + rows
    return out


@pytest.mark.parametrize("broken", [False, True])
def test_captured_rounds_save_prefix_states_as_eager_ones(setup, captured, monkeypatch, broken):
    """A captured verify's commit (the accepted prefixes, stored after the forward) saves the prefix
    states of the page boundaries it completes, as an eager round's does: slot 1 crosses 128 and
    slot 4 crosses 256 while decoding. The broken variant: a bucket plan's accepted-prefix stores
    save none (as its in-graph whole-forward store must not), and those boundaries are missing."""
    model, prompts, want, replay = setup
    cache, graphs = captured
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    monkeypatch.setattr(cache, "prefix", None)  # the shared cache gets its store back at teardown
    cache.enable_prefix_states()
    eager_cache = _cache(model)
    eager_cache.enable_prefix_states()
    if broken:
        real = kv_plan._write_lists

        def no_states(plan, lengths):
            lists = real(plan, lengths)
            lists.static = plan.bucket is not None
            return lists

        monkeypatch.setattr(kv_plan, "_write_lists", no_states)
    eager, *_ = _serve(model, "dspark_static", prompts, replay, (eager_cache, None))
    got, _, replayed, _ = _serve(model, "dspark_static", prompts, replay, captured)
    assert eager == want and got == want and replayed
    want_states, got_states = _saved(eager_cache.prefix), _saved(cache.prefix)
    decoded = {(int(eager_cache.key_slots[s, b - 1]), b) for s, b in ((1, 128), (4, 256))}
    assert decoded <= set(want_states)
    if broken:
        assert not decoded & set(got_states)
        return
    assert set(got_states) == set(want_states)
    for k in want_states:
        torch.testing.assert_close(got_states[k], want_states[k], atol=1e-4, rtol=1e-4)


def test_stale_accepted_write_lists_are_caught(setup, captured, monkeypatch):
    """Broken variant: the bucket's refresh keeps the accepted-prefix write lists an earlier round
    computed (another batch's rows), so this round's accepted rows are stored where those went."""
    model, prompts, want, replay = setup
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    real = kv_plan._refresh

    def stale(static, fresh):
        kept = dict(static._writes) if isinstance(static, kv_plan.ForwardPlan) else None
        real(static, fresh)
        if kept is not None:
            static._writes.update({k: v for k, v in kept.items() if k not in (None, "zeros")})

    monkeypatch.setattr(kv_plan, "_refresh", stale)
    got, *_ = _serve(model, "dspark_static", prompts, replay, captured)
    assert got != want


def test_bucket_choice(captured):
    graphs = captured[1]
    assert graphs.bucket_for([Segment(1, 10, 4)]) == kv_plan.Bucket(5, WIDTH, CONTEXT)
    assert graphs.bucket_for([Segment(1, 10, 5), Segment(2, 5, 1)]) == kv_plan.Bucket(20, WIDTH, CONTEXT)
    assert graphs.bucket_for([Segment(1, CONTEXT, 5), Segment(2, 5, 1)]) == kv_plan.Bucket(20, WIDTH, CONTEXT)
    assert graphs.bucket_for([Segment(s, 10, 5) for s in range(5)]) is None  # 25 rows
    assert graphs.bucket_for([Segment(1, 10, 6)]) is None  # wider than the captured width
    assert graphs.bucket_for([Segment(1, 10, 1), Segment(2, CONTEXT + 1, 1)]) is None  # past the context


def test_the_worker_captures_what_the_flags_ask(monkeypatch):
    """spec_graph_sizes reads the record SGLang hands the worker, which keeps the user's flags; on
    CUDA / NPU the device graphs (unverified there) are opt-in."""
    from sglang_dsv4_ascend.integration.server_defaults import CPU_GRAPH_BS, spec_graph_sizes

    def args(**kw):
        base = dict(device=None, enable_torch_compile=False, disable_cuda_graph=False, cuda_graph_bs_decode=None)
        return types.SimpleNamespace(**{**base, **kw})

    assert spec_graph_sizes(args(), "cpu") == ()
    assert spec_graph_sizes(args(enable_torch_compile=True), "cpu") == CPU_GRAPH_BS
    assert spec_graph_sizes(args(enable_torch_compile=True, cuda_graph_bs_decode=[4, 2, 2]), "cpu") == (2, 4)
    assert spec_graph_sizes(args(enable_torch_compile=True, disable_cuda_graph=True), "cpu") == ()
    # --device unset on an NPU machine: the worker's device decides (graphs stay off there)
    assert spec_graph_sizes(args(enable_torch_compile=True), "npu") == ()
    monkeypatch.setenv("SGLANG_DSV4_DEVICE_GRAPHS", "1")
    assert spec_graph_sizes(args(), "npu") == CPU_GRAPH_BS
    assert spec_graph_sizes(args(cuda_graph_bs_decode=[8]), "cuda") == (8,)
    assert spec_graph_sizes(args(disable_cuda_graph=True), "npu") == ()
    assert spec_graph_sizes(args(), "cpu") == ()  # on CPU --enable-torch-compile decides


# -- the DSpark draft block captured per request bucket (graphs.DraftGraphs) ---------------------
DRAFT_PROMPTS = (61, 7, 100)  # one per slot; the longest crosses the draft's context window
DRAFT_LIVE = [[0, 1, 2], [1], [0, 2], [2], [0, 1]]  # batches of 1..3 requests: buckets 1 and 4


@pytest.fixture(scope="module")
def draft_captured(tiny_checkpoint):
    """(trunk, draft, engine whose draft block is captured for 1 and 4 requests, its DraftGraphs)."""
    from torch._dynamo.utils import counters

    from sglang_dsv4_ascend.models.dspark import load_dspark_from_dir
    from sglang_dsv4_ascend.models.weights import load_model_from_dir
    from sglang_dsv4_ascend.speculative.graphs import DraftGraphs

    path = tiny_checkpoint("flash", "dspark")
    trunk = load_model_from_dir(path)
    draft = load_dspark_from_dir(path, trunk.cfg)
    eng = dspark_engine(trunk, draft, len(DRAFT_PROMPTS), 4, None)
    compile_fn = lambda f: torch.compile(f, dynamic=False, backend="eager")  # noqa: E731
    graphs = DraftGraphs(draft, eng.drafter.ctx, 4, (1, 4), trunk.embed, trunk.compute_logits, compile_fn)
    counters.clear()
    logged = []
    graphs.capture(log=logged.append)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    for n, line in zip((1, 4), logged):  # its time and the memory it added
        assert re.fullmatch(
            rf"dsv4_ascend: DSpark draft block of {n} requests captured in [\d.]+ s, [+-][\d.]+ MiB", line
        )
    # `bench startup` reads these lines back out of a server log (no cache figures: trace only)
    from sglang_dsv4_ascend.bench.startup import captures

    rows = captures("\n".join(["noise"] + logged))
    assert [r["what"] for r in rows] == ["DSpark draft block of 1 requests", "DSpark draft block of 4 requests"]
    assert all(set(r) == {"what", "s", "mib"} and r["s"] >= 0 for r in rows), rows
    eng.draft_graphs = graphs
    return trunk, draft, eng, graphs


def _draft_serve(trunk, eng):
    """Prefill DRAFT_PROMPTS (one per slot), then rounds with the engine's real drafts over
    DRAFT_LIVE until every request has N_NEW tokens -> (tokens per slot, every round's drafted
    trees as (tokens, parents), prompts)."""
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 1000, (n,), generator=g).tolist() for n in DRAFT_PROMPTS]
    draft_cache = getattr(eng.drafter, "draft_cache", None)  # NextN's (a captured one is shared)
    for s in range(len(prompts)):
        eng.cache.reset_slot(s)
        if draft_cache is not None:
            draft_cache.reset_slot(s)
    got = prefill(trunk, eng, prompts)
    lens, drafted, step = [len(p) for p in prompts], [], 0
    while min(map(len, got)) < N_NEW:
        live = [s for s in DRAFT_LIVE[step % len(DRAFT_LIVE)] if len(got[s]) < N_NEW] or [
            s for s in range(len(got)) if len(got[s]) < N_NEW
        ]
        step += 1
        r = eng.round(live, [lens[s] for s in live], [got[s][-1] for s in live], None, None, live)
        drafted.append([(t.tokens, t.parents) for t in r.trees])
        for s, e, a in zip(live, r.emitted, r.accept_lens):
            got[s] += e
            lens[s] += a
    return [x[:N_NEW] for x in got], drafted, prompts


def test_captured_draft_block_drafts_what_eager_drafts(draft_captured, monkeypatch):
    """Rounds with the captured block draft the same chains as the eager block, round by round,
    and emit plain greedy decoding's tokens; the block's logits and confidence features agree
    with eager's within float noise for batches padded to either bucket."""
    trunk, draft, eng, graphs = draft_captured
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    eager_eng = dspark_engine(trunk, draft, len(DRAFT_PROMPTS), 4, None)
    want_tokens, want_drafts, prompts = _draft_serve(trunk, eager_eng)
    got_tokens, got_drafts, _ = _draft_serve(trunk, eng)
    assert want_tokens == plain_greedy(trunk, prompts, N_NEW)
    assert got_tokens == want_tokens and got_drafts == want_drafts
    assert graphs.replayed == {1, 4}
    for slots in ([0, 2], [1], [2, 1, 0]):
        starts, anchors = [40 + 9 * s for s in slots], torch.tensor([5 + s for s in slots])
        U, h, x, c = graphs.run(slots, starts, anchors)
        U0, h0 = draft.block(eng.drafter.ctx, slots, starts, anchors, 4, trunk.embed, trunk.compute_logits)
        torch.testing.assert_close((U, h), (U0, h0), atol=1e-5, rtol=1e-5)
        x0, _, c0 = draft.markov_chain(U0, h0, anchors, [None] * len(slots), None)
        assert torch.equal(x, x0)
        torch.testing.assert_close(c, c0, atol=1e-5, rtol=1e-5)


def test_greedy_rounds_draft_the_captured_chain(draft_captured, monkeypatch):
    """A greedy round drafts the Markov chain the captured graph computed (markov_greedy after the
    stages), not an eager chain after it: with the graph's chain shifted on purpose, the first
    round's drafts are the shifted ones, and the output is still plain greedy decoding's."""
    trunk, draft, eng, graphs = draft_captured
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    want_tokens, want_drafts, prompts = _draft_serve(trunk, dspark_engine(trunk, draft, len(DRAFT_PROMPTS), 4, None))
    real, V = graphs.run, trunk.cfg.vocab_size

    def shifted(*args):
        U, h, x, c = real(*args)
        return U, h, (x + 1) % V, c

    monkeypatch.setattr(graphs, "run", shifted)
    got_tokens, got_drafts, _ = _draft_serve(trunk, eng)
    first = [(type(t)([t[0]] + [(v + 1) % V for v in t[1:]]), p) for t, p in want_drafts[0]]
    assert got_drafts[0] == first and got_tokens == want_tokens


def test_stale_draft_block_inputs_are_caught(draft_captured, monkeypatch):
    """Broken variant: a bucket's buffers kept from an earlier batch (not refilled in place)."""
    from sglang_dsv4_ascend.speculative.graphs import DraftGraphs

    trunk, draft, eng, graphs = draft_captured
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    monkeypatch.setattr(DraftGraphs, "_load", lambda self, n, *a: self.inputs[n])
    slots, starts, anchors = [0, 2], [50, 90], torch.tensor([3, 4])
    U = graphs.run(slots, starts, anchors)[0]
    U0, _ = draft.block(eng.drafter.ctx, slots, starts, anchors, 4, trunk.embed, trunk.compute_logits)
    assert not torch.allclose(U, U0, atol=1e-3)


# -- NextN's draft steps captured per row bucket (graphs.NextNStepGraphs) -------------------------
NEXTN_SHAPES = {"chain": (1, 3, 4), "tree": (2, 3, 6)}  # topk, steps, draft tokens


@pytest.fixture(scope="module")
def nextn_captured(setup, tiny_ckpt):
    """(trunk, NextN block, a draft cache, its NextNStepGraphs: paths of up to 2 tokens, 4 or 16
    rows: 1 or 4 requests of the topk-2 tree's deepest step)."""
    from torch._dynamo.utils import counters

    from sglang_dsv4_ascend.models.nextn import load_nextn_from_dir
    from sglang_dsv4_ascend.speculative.graphs import NextNStepGraphs

    trunk = setup[0]
    nextn = load_nextn_from_dir(tiny_ckpt("flash"), trunk.cfg)
    cache = nextn.make_cache(len(DRAFT_PROMPTS), 128, 6)
    compile_fn = lambda f: torch.compile(f, dynamic=False, backend="eager")  # noqa: E731
    graphs = NextNStepGraphs(nextn, cache, trunk.embed, 2, (4, 16), compile_fn=compile_fn)
    counters.clear()
    graphs.capture(log=lambda msg: None)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    return trunk, nextn, cache, graphs


def _nextn_serve(trunk, nextn, shape, draft_cache=None, graphs=None):
    """_draft_serve with a NextN engine of `shape` (its draft steps captured when `graphs`, which
    read `draft_cache`)."""
    from sglang_dsv4_ascend.speculative.drafters import NextNDrafter

    topk, steps, n_draft = NEXTN_SHAPES[shape]
    host = types.SimpleNamespace(model=trunk, nextn=nextn, cfg=trunk.cfg)
    cache = trunk.make_cache(len(DRAFT_PROMPTS), 128, n_draft)
    eng = SpecEngine(host, cache, NextNDrafter, torch.Generator(), topk=topk, num_steps=steps, num_draft_tokens=n_draft)
    if draft_cache is not None:  # the captured steps read this one
        eng.drafter.draft_cache = draft_cache
    eng.draft_graphs = graphs
    return _draft_serve(trunk, eng)


@pytest.mark.parametrize("shape", list(NEXTN_SHAPES))
def test_captured_nextn_steps_draft_what_eager_drafts(nextn_captured, shape, monkeypatch):
    """Chain and tree rounds whose draft steps replay the captured forward (padded to 4 or 16
    rows) draft the same trees as eager steps, round by round, and emit plain greedy tokens."""
    trunk, nextn, cache, graphs = nextn_captured
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    want, want_drafts, prompts = _nextn_serve(trunk, nextn, shape)
    before = graphs.replays
    got, got_drafts, _ = _nextn_serve(trunk, nextn, shape, cache, graphs)
    assert want == plain_greedy(trunk, prompts, N_NEW)
    assert got == want and got_drafts == want_drafts
    assert graphs.replays - before == 2 * len(got_drafts)  # both draft steps of every round
    assert graphs.replayed == set(graphs.buckets)


def test_stale_nextn_step_plans_are_caught(nextn_captured, monkeypatch):
    """Broken variant: a bucket's plan not refreshed (the capture's padding plan read again): the
    drafts change, the output (lossless whatever is drafted) does not."""
    trunk, nextn, cache, graphs = nextn_captured
    monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)
    want, want_drafts, _ = _nextn_serve(trunk, nextn, "chain")
    real = kv_plan.PlanBuffers.load
    monkeypatch.setattr(
        kv_plan.PlanBuffers,
        "load",
        lambda self, segs, bucket, device=None: self.plans.get(bucket) or real(self, segs, bucket, device),
    )
    got, got_drafts, _ = _nextn_serve(trunk, nextn, "chain", cache, graphs)
    assert got == want and got_drafts != want_drafts


# -- the same forwards as device graphs (device_graph.DeviceGraphs, CUDA / NPU), emulated on CPU ---
def _emulated(fn):
    from sglang_dsv4_ascend import device_graph

    return device_graph.DeviceGraphs(fn, device_graph.emulated_api())


@pytest.mark.parametrize("method", ["nextn_chain", "dspark_adaptive"])
def test_device_graph_verify_serves_like_eager(setup, method):
    """The verify as a device graph replays it (emulated: the captured tensors read and rewritten,
    no Python run at a replay, so its deferred writes and the draft's streams reach the round
    only through what device_graph.py redoes): plain greedy tokens, the eager engine's cache."""
    model, prompts, want, replay = setup
    cache = _cache(model)
    graphs = VerifyGraphs(model, cache, WIDTH, ROWS, compile_fn=_emulated, context=CONTEXT)
    graphs.capture(log=lambda msg: None)
    assert len(graphs.fn.captured) == len(ROWS)
    eager, eager_eng, *_ = _serve(model, method, prompts, replay)
    got, eng, replayed, rounds = _serve(model, method, prompts, replay, (cache, graphs))
    assert got == want and replayed > 0 and len(graphs.fn.captured) == len(ROWS)
    assert _state_gap(eng, eager_eng) < 1e-4


def test_device_graph_draft_block_and_nextn_steps_draft_what_eager_drafts(draft_captured, nextn_captured):
    """The DSpark block (its inputs in persistent buffers, passed as the captured tensors
    themselves) and NextN's draft steps (an extra input of streams, every step's writes appended)
    as device graphs draft what eager forwards draft, round by round."""
    from sglang_dsv4_ascend.speculative.graphs import DraftGraphs, NextNStepGraphs

    trunk, draft, eng, _ = draft_captured
    eager_eng = dspark_engine(trunk, draft, len(DRAFT_PROMPTS), 4, None)
    want, want_drafts, _ = _draft_serve(trunk, eager_eng)
    emu = dspark_engine(trunk, draft, len(DRAFT_PROMPTS), 4, None)
    emu.draft_graphs = DraftGraphs(draft, emu.drafter.ctx, 4, (1, 4), trunk.embed, trunk.compute_logits, _emulated)
    emu.draft_graphs.capture(log=lambda msg: None)
    got, got_drafts, _ = _draft_serve(trunk, emu)
    assert got == want and got_drafts == want_drafts and emu.draft_graphs.replayed == {1, 4}
    ntrunk, nextn, _, _ = nextn_captured
    want, want_drafts, _ = _nextn_serve(ntrunk, nextn, "tree")
    cache = nextn.make_cache(len(DRAFT_PROMPTS), 128, 6)
    steps = NextNStepGraphs(nextn, cache, ntrunk.embed, 2, (4, 16), compile_fn=_emulated)
    steps.capture(log=lambda msg: None)
    got, got_drafts, _ = _nextn_serve(ntrunk, nextn, "tree", cache, steps)
    assert got == want and got_drafts == want_drafts and steps.replayed == set(steps.buckets)
