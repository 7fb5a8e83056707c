"""Graph capture of the non-speculative decode through the dsv4_ascend backend's graph protocol
(attention_backend/backend.py, kvcache/plan.py PlanBuffers), driven here the way SGLang's graph
runners drive it: capture per batch size with every row padding (request slot 0), then for each
step pad the batch up to the next captured size, refresh the metadata outside the captured region
and replay.

Two kinds of replay:
* `torch.compile` (what SGLang's CPUGraphRunner does) with "aot_eager": dynamo's tracing and
  guards, and the functionalised graph a code generator sees, whose cache writes (in-place stores
  into the caller's tensors) must still land. Inductor's code itself is compared with eager by
  `python -m sglang_dsv4_ascend.bench step --graph` (minutes per batch size on this CPU, too slow
  for the suite);
* an address graph: the forward run on the plan object recorded at capture, whatever the backend
  holds now, as a CUDA / ACL graph reads the addresses it recorded. It catches metadata that is
  not refreshed in place.

The oracle is the eager, unpadded forward on a twin cache: logits of the real rows and every
request's final cache state."""

import bisect
import re
from types import SimpleNamespace

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode

from sglang_dsv4_ascend import settings
from sglang_dsv4_ascend.attention_backend.backend import PADDING_SLOT, DSV4AscendBackend
from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.kvcache import plan as kv_plan

TOL = dict(atol=2e-5, rtol=2e-5)
SLOTS = 6  # slot 0 is SGLang's reserved padding slot; requests use 1..5
CAPTURE_BS = (2, 4)


def _backend(model, cache):
    runner = SimpleNamespace(
        req_to_token_pool=SimpleNamespace(req_generation=torch.zeros(SLOTS, dtype=torch.long)),
        token_to_kv_pool=SimpleNamespace(cache=cache),
    )
    return DSV4AscendBackend(runner)


def _prefill(model, cache, contexts):
    for slot, L in contexts.items():
        ids = (torch.arange(L) * 13 + slot) % 1000
        model(ids, torch.arange(L), [Segment(slot, 0, L)], cache)


class Runner:
    """What SGLang's graph runners do around the backend (cpu_graph_runner.CPUGraphRunner)."""

    def __init__(self, model, backend, graph: str, capture=CAPTURE_BS):
        self.model, self.backend, self.graph, self.capture = model, backend, graph, capture
        backend.init_cpu_graph_state(max(capture), max(capture))
        compiled = graph != "address"  # else a torch.compile backend
        self.fn = torch.compile(self._step, dynamic=False, backend=graph) if compiled else self._step
        self.recorded, self.eager_steps = {}, 0
        for bs in capture:
            backend.init_forward_metadata_capture_cpu_graph(bs, bs, None, None, None, None, ForwardMode.DECODE, None)
            self.recorded[bs] = backend.forward_metadata.plan  # what a device graph would read
            for _ in range(2):  # warm-up and capture runs: padding rows only
                self.fn(torch.zeros(bs, dtype=torch.long), torch.zeros(bs, dtype=torch.long), bs)

    def _step(self, ids, pos, bs):
        meta = self.backend.forward_metadata
        plan = self.recorded[bs] if self.graph == "address" else meta.plan
        # the request list as the served model passes it: a bucket plan's forward must ignore it
        return self.model.compute_logits(self.model(ids, pos, meta.segments, self.backend.cache, plan=plan))

    def decode(self, slots, contexts, ids):
        n = len(slots)
        seq_lens = torch.tensor([contexts[s] + 1 for s in slots])
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            batch_size=n,
            req_pool_indices=torch.tensor(list(slots)),
            seq_lens=seq_lens,
            seq_lens_cpu=seq_lens,
            positions=seq_lens - 1,
        )
        if not self.backend.graph_holds(batch):  # the runner's can_run_graph: this step runs eager
            self.eager_steps += 1
            self.backend.init_forward_metadata(batch)
            meta = self.backend.forward_metadata
            out = self.model(ids, batch.positions, meta.segments, self.backend.cache, plan=meta.plan)
            return self.model.compute_logits(out)
        bs = self.capture[bisect.bisect_left(self.capture, n)]
        pad = bs - n
        seq_lens = torch.tensor([contexts[s] + 1 for s in slots] + [1] * pad)
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            req_pool_indices=torch.tensor(list(slots) + [PADDING_SLOT] * pad),
            seq_lens=seq_lens,
            seq_lens_cpu=None,  # the runner's captured batch has none: positions are read
            positions=seq_lens - 1,
        )
        self.backend.init_forward_metadata(batch)
        padded = torch.cat([ids, torch.zeros(pad, dtype=torch.long)])
        return self.fn(padded, batch.positions, bs)[:n]


# Requests joining and leaving: batch sizes 1..4 over two buckets (1 and 3 requests padded).
LIVE = [[1], [1, 2], [2, 1, 3], [1, 3, 4, 2], [4, 2], [5, 4, 2], [3], [1, 2, 3, 4]]


def _run(model, graph, steps, contexts, after_warmup=None, capture=CAPTURE_BS, live=LIVE):
    graph_cache, twin = model.make_cache(SLOTS, 640), model.make_cache(SLOTS, 640)
    for c in (graph_cache, twin):
        _prefill(model, c, contexts)
    runner = Runner(model, _backend(model, graph_cache), graph, capture)
    if after_warmup is not None:
        after_warmup()
    ctx = dict(contexts)
    worst = 0.0
    for slots in (live[i % len(live)] for i in range(steps)):
        ids = torch.tensor([(ctx[s] * 7 + s) % 1000 for s in slots])
        got = runner.decode(slots, ctx, ids)
        pos, segs = torch.tensor([ctx[s] for s in slots]), [Segment(s, ctx[s], 1) for s in slots]
        want = model.compute_logits(model(ids, pos, segs, twin))
        worst = max(worst, (got - want).abs().max().item())
        for s in slots:
            ctx[s] += 1
    state = max(
        (v - twin.slot_state(s)[k]).abs().max().item() for s in contexts for k, v in graph_cache.slot_state(s).items()
    )
    return worst, state, runner


CONTEXTS = {1: 300, 2: 126, 3: 7, 4: 511, 5: 64}  # C4 and C128 boundaries crossed during the run


@pytest.mark.parametrize("graph", ["aot_eager", "address"])
def test_replay_equals_eager_across_buckets_joins_and_leaves(dsv4_model, graph, monkeypatch):
    """100 steps; contexts and the batch's requests change every step. Compiled (aot_eager: the
    functionalised graph a code generator gets, whose cache stores become copies back into the
    caller's tensors): after warm-up the traced forward must guard on nothing but the bucket
    (dynamo raises on a recompile once error_on_recompile is set)."""
    torch._dynamo.reset()

    def strict():
        monkeypatch.setattr(torch._dynamo.config, "error_on_recompile", True)

    # captured up to 512 committed tokens of the 640-token cache: slot 4 decodes at 511 and 512
    # replayed, and every later step with slot 4 runs eager
    monkeypatch.setenv(settings.GRAPH_CONTEXT.name, "512")
    logits, state, runner = _run(dsv4_model("flash"), graph, 100, CONTEXTS, after_warmup=strict)
    assert logits < 1e-4 and state < 1e-4
    with_slot_4 = sum(4 in LIVE[i % len(LIVE)] for i in range(100))
    assert 0 < runner.eager_steps == with_slot_4 - 2
    # every captured size kept one plan, and its tensors are the ones recorded at capture
    assert set(runner.backend.graph_plans.plans) == {kv_plan.Bucket(bs, 1, 512) for bs in CAPTURE_BS}
    for bs, plan in runner.recorded.items():
        assert runner.backend.graph_plans.plans[kv_plan.Bucket(bs, 1, 512)] is plan
        assert plan.ratios[4].max_committed == 512 // 4  # not the cache's 640 + slack


@pytest.mark.skipif(not settings.TEST_INDUCTOR.get(), reason=f"{settings.TEST_INDUCTOR.name}=1 runs it (~2 min)")
def test_inductor_capture_equals_eager(dsv4_model):
    """Inductor's code, compiled as the plugin's CPU graph runner configures it (SGLang's settings,
    freezing off: integration/graph_runner.py): the cache stores land and the logits stay within
    fp32 rounding of eager."""
    import torch._inductor.config
    from sglang.srt.model_executor.cpu_graph_runner import set_torch_compile_config

    from sglang_dsv4_ascend.device import configure_inductor

    torch._dynamo.reset()
    set_torch_compile_config()
    configure_inductor()
    live = [[1], [1, 2], [3, 2], [4], [2, 5]]  # one captured size, exact and padded
    logits, state, _ = _run(dsv4_model("flash"), "inductor", 10, CONTEXTS, capture=(2,), live=live)
    assert logits < 1e-4 and state < 1e-4


def test_capture_log_says_whether_inductor_compiled_or_loaded(tmp_path, monkeypatch):
    """A capture's log line (device.capture_meter) tells a compilation from a load out of inductor's
    cache: a cold start spends minutes per graph on this CPU, a warm one seconds. Two functions
    with the same graph stand for a server started twice (dynamo keeps no state between them);
    a trace-only compiler says nothing about a cache."""
    from sglang_dsv4_ascend.device import capture_meter

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    src = "def f(x):\n    return (x.sin() * 2 + 1).sum(-1)\n"
    lines = []
    for _ in range(2):
        scope = {}
        exec(compile(src, "<capture>", "exec"), scope)  # a new code object: a new dynamo trace
        spent = capture_meter()
        torch.compile(scope["f"], dynamic=False, backend="inductor")(torch.randn(4, 8))
        lines.append(spent())
    assert re.fullmatch(r"[\d.]+ s, [+-][\d.]+ MiB, inductor cache: 0 hit, 1 missed", lines[0]), lines
    assert re.fullmatch(r"[\d.]+ s, [+-][\d.]+ MiB, inductor cache: 1 hit, 0 missed", lines[1]), lines
    # as `bench startup` reads a decode capture line back out of a server log
    from sglang_dsv4_ascend.bench.startup import captures

    line = f"[t] dsv4_ascend: decode batch size 4 captured (torch.compile, inductor) in {lines[1]}"
    (row,) = captures(line)
    assert row["what"] == "decode batch size 4" and (row["cache_hit"], row["cache_missed"]) == (1, 0), row
    spent = capture_meter()
    torch.compile(lambda x: x * 3, backend="eager")(torch.randn(3))
    assert re.fullmatch(r"[\d.]+ s, [+-][\d.]+ MiB", spent())


def test_inductor_rounds_bf16_as_eager_does(tmp_path, monkeypatch):
    """device.configure_inductor: a fused bf16 chain compiled by inductor equals eager bit for bit
    (each op rounded to bf16, as eager rounds it). Left to itself inductor keeps the chain in fp32
    and rounds once, which moved the shipped model's captured verify twice as far from fp32 as
    eager bf16 (bench step --graph); that variant is caught here."""
    from sglang_dsv4_ascend.device import configure_inductor

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    x, w = (torch.randn(64, 256, generator=g).to(torch.bfloat16) for _ in range(2))

    def chain(x, w):
        y = x * w + x
        return (y * y.sigmoid() - w) * 3.7

    want = chain(x, w)
    with torch._inductor.config.patch(emulate_precision_casts=False):  # the broken variant
        fused = torch.compile(chain, dynamic=False, backend="inductor")(x, w)
    assert not torch.equal(fused, want)
    torch._dynamo.reset()
    with torch._inductor.config.patch(freezing=True, emulate_precision_casts=False):
        configure_inductor()  # as the runner calls it, after SGLang's settings
        got = torch.compile(chain, dynamic=False, backend="inductor")(x, w)
        assert not torch._inductor.config.freezing
    assert torch.equal(got, want)


def test_a_fresh_plan_at_replay_is_caught(dsv4_model, monkeypatch):
    """Broken variant: each step's plan built anew instead of copied into the captured buffers. A
    compiled function would not notice; a device graph replays the captured plan (all padding)."""

    def fresh(self, segments, bucket, device=None):
        plan = kv_plan.build_plan(segments, self.cache, device=device, bucket=bucket)
        self.plans.setdefault(bucket, plan)
        return plan

    monkeypatch.setattr(kv_plan.PlanBuffers, "load", fresh)
    logits, state, _ = _run(dsv4_model("flash"), "address", 6, CONTEXTS)
    assert logits > 1e-3 and state > 1e-3


def test_stale_write_lists_from_an_earlier_batch_are_caught(dsv4_model, monkeypatch):
    """Broken variant: the refresh leaves the write lists of the step that first filled the
    buffers (another batch's rows), so this step's rows are stored where that one's went."""
    real = kv_plan._refresh

    def stale(static, fresh):
        if isinstance(static, kv_plan.ForwardPlan):
            monkeypatch.setattr(fresh, "writes", static.writes)
        real(static, fresh)

    monkeypatch.setattr(kv_plan, "_refresh", stale)
    logits, state, _ = _run(dsv4_model("flash"), "address", 8, CONTEXTS)
    assert logits > 1e-3 or state > 1e-3


def test_capture_is_decode_only_and_needs_the_batched_path(dsv4_model):
    model = dsv4_model("flash")
    backend = _backend(model, model.make_cache(SLOTS, 640))
    backend.init_cpu_graph_state(4, 4)
    with pytest.raises(ValueError, match="decode batches only"):
        backend.init_forward_metadata_capture_cpu_graph(4, 16, None, None, None, None, ForwardMode.TARGET_VERIFY, None)
    backend.build_plans = False  # SGLANG_DSV4_ATTENTION=segments
    with pytest.raises(ValueError, match="SGLANG_DSV4_ATTENTION=segments"):
        backend.init_cpu_graph_state(4, 4)


def test_the_runner_decodes_eager_past_the_captured_context(dsv4_model, monkeypatch):
    """The plugin's CPU graph runner (SGLang's CPUGraphRunner, integration/graph_runner.py) asks the
    backend before a replay: a batch with a request past SGLANG_DSV4_GRAPH_CONTEXT runs eager,
    whatever its size. A runner on an SGLang whose overridden methods changed is refused."""
    from sglang_dsv4_ascend.integration import graph_runner
    from sglang_dsv4_ascend.integration.compat import UnsupportedSGLang

    monkeypatch.setenv(settings.GRAPH_CONTEXT.name, "512")
    model = dsv4_model("flash")
    backend = _backend(model, model.make_cache(SLOTS, 640))
    backend.init_cpu_graph_state(4, 4)
    runner = object.__new__(graph_runner.cpu_graph_runner_cls())
    runner.model_runner = SimpleNamespace(attn_backend=backend)
    runner.disable_padding, runner.max_bs, runner.graphs = False, 4, {}

    def batch(*lens):
        seq = torch.tensor([n + 1 for n in lens])
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            batch_size=len(lens),
            req_pool_indices=torch.arange(1, len(lens) + 1),
            seq_lens=seq,
            seq_lens_cpu=seq,
            positions=seq - 1,
        )

    assert runner.can_run_graph(batch(10, 512))
    assert not runner.can_run_graph(batch(10, 513))
    assert not runner.can_run_graph(batch(*[10] * 5))  # SGLang's own test: above the largest size

    class Renamed:
        def capture_one_batch_size(self, bs, forward, skip_cross_attention=False): ...

        def can_run(self, forward_batch): ...

    with pytest.raises(
        UnsupportedSGLang,
        match=r"Renamed\.can_run_graph \(overridden by sglang-dsv4-ascend\) has parameters None, "
        r"expected \('self', 'forward_batch'\)",
    ):
        graph_runner._check_overridden(Renamed)
