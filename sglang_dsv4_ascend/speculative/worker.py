"""`--speculative-algorithm nextn` (SGLang's EAGLE family) and `dspark` for our DeepSeek-V4: chain
(topk 1) and tree (topk > 1) drafting with the checkpoint's NextN block, or DSpark block drafting
with static / adaptive verify (planner.py), then verify, lossless accept, KV commit.

Entered through SGLang's seam for out-of-tree platforms (`get_speculative_worker_cls`), and on
its builtin platforms (the NPU one) through the routing hook (patches/README.md #8, unverified on
NPU hardware); the scheduler is untouched and sees what it
expects of a spec-v2 EAGLE worker: `GenerationBatchResult` with `next_token_ids` (stride
`speculative_num_draft_tokens`), `accept_lens` (bonus included), `new_seq_lens` and an
`EagleDraftInput` (subclass) carrying each request's bonus token. The round itself is
engine.NextNEngine (no SGLang objects); this module adapts batches to it.

Prefill runs the target through SGLang's own worker (the model keeps its pre-head streams), then
the draft extend over the chunk. Rounds run synchronously: overlap scheduling is declared off.
"""

from __future__ import annotations

import logging

import torch
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.eagle_info import EagleDraftInput

from .. import checkpoint, settings
from ..device import graph_kind
from ..distributed.spec_sync import RankSync
from ..kvcache import plan as kv_plan
from ..models.dspark import load_sts, sts_path
from ..names import DSPARK_ALGO, SPEC_ALGOS
from . import cost as cost_surface
from .drafters import make_drafter
from .engine import NextNEngine, SpecEngine, check_tree_shape
from .guard import Guard, plain_round_seconds
from .planner import Planner, measure_cost, verify_mode
from .shapes import ShapePlanner
from .shapes import measure as measure_shapes
from .stats import StageStats

logger = logging.getLogger("sglang_dsv4_ascend")


def worker_cls_for(algorithm: str):
    """Our worker for EAGLE / NEXTN / DSPARK on DeepSeek-V4; None (SGLang's own) otherwise."""
    if str(algorithm).upper() in SPEC_ALGOS and checkpoint.serves_dsv4():
        return DSV4SpecWorker
    return None


class DSV4DraftInput(EagleDraftInput):
    """What travels with the batch between rounds: the bonus token of each request. The rest of
    the draft state is per request slot in the worker, so filtering and merging need only this."""

    def __init__(self, bonus_tokens: torch.Tensor):
        super().__init__(
            bonus_tokens=bonus_tokens,
            topk_p=bonus_tokens.new_zeros((len(bonus_tokens), 0)).float(),
            topk_index=bonus_tokens.new_zeros((len(bonus_tokens), 0)),
            hidden_states=None,
        )

    def prepare_for_decode(self, batch):
        """SGLang's decode preparation asks a DSPARK batch's draft input to reserve the next
        round's KV slots (its DFlash inputs over-allocate for overlap scheduling); our rounds are
        synchronous, so this is the EAGLE reservation NEXTN batches get."""
        from sglang.srt.speculative.eagle_utils import eagle_prepare_for_decode

        eagle_prepare_for_decode(batch)

    def filter_batch(self, new_indices, new_indices_cpu=None):
        self.bonus_tokens = self.bonus_tokens[new_indices]
        self.topk_p, self.topk_index = self.topk_p[new_indices], self.topk_index[new_indices]

    def merge_batch(self, spec_info):
        self.bonus_tokens = torch.cat([self.bonus_tokens, spec_info.bonus_tokens.to(self.bonus_tokens)])
        self.topk_p = self.topk_p.new_zeros((len(self.bonus_tokens), 0))
        self.topk_index = self.topk_index.new_zeros((len(self.bonus_tokens), 0))


class DraftState:
    """The speculative draft's per-request state, as SGLang's PD transfer sees a draft pool."""

    def __init__(self, worker):
        self.worker = worker

    def get_contiguous_buf_infos(self):
        return [], [], []  # no paged draft KV: everything is per request slot

    def request_row_tensors(self) -> list:
        self.worker._ensure_state()  # the engine is built lazily, after SGLang's pool
        return self.worker.engine.drafter.request_row_tensors()


class DSV4SpecWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.algo = str(spec.speculative_algorithm).upper()
        self.num_draft_tokens = spec.speculative_num_draft_tokens
        runner = target_worker.model_runner
        self.runner = runner
        self.model = runner.model
        self.device = torch.device(runner.device)
        if self.algo == DSPARK_ALGO:
            self.gamma = self.num_draft_tokens - 1  # SGLang resolved --speculative-dspark-block-size + 1
            self.topk, self.num_steps = 1, self.gamma
            if getattr(self.model, "dspark", None) is None:
                raise ValueError("--speculative-algorithm dspark: the DeepSeek-V4 model has no DSpark draft loaded")
            self.verify_mode = verify_mode()
            self.sts_path = sts_path(spec.speculative_dspark_confidence_sts_path, server_args.model_path)
            self.model.dspark.sts = load_sts(self.sts_path)
            self.sps_table = spec.speculative_dspark_sps_table_path
            self.model.capture_aux = {"layer_ids": tuple(self.model.cfg.dspark_target_layer_ids)}
        else:
            self.topk = spec.speculative_eagle_topk or 1
            self.num_steps = spec.speculative_num_steps
            check_tree_shape(self.num_steps, self.topk, self.num_draft_tokens)
            if getattr(self.model, "nextn", None) is None:
                raise ValueError(
                    "--speculative-algorithm nextn: the DeepSeek-V4 model has no NextN (mtp.0) block loaded"
                )
            self.model.capture_aux = {}
        self.engine = None
        self.pd_prefill = str(getattr(server_args, "disaggregation_mode", "null")) == "prefill"
        self.stats = StageStats()
        # the startup cost seed (DSpark adaptive's surface, NextN's shapes), if one is measured: its
        # one-row forwards are the guard's plain step too
        self._seed = None
        # Every TP rank runs this worker on the same batch; its decisions must agree
        # (distributed/spec_sync.py says how each one does).
        self.sync = RankSync.from_sglang()
        # the ranks serving the same requests (all TP ranks without DP attention): decisions agree there
        self.decisions = RankSync.from_sglang(attention=True)
        if self.decisions.checking:
            logger.info(
                "dsv4_ascend: %s=1: every round's decisions compared over %d ranks (rank %d of them)",
                settings.SPEC_SYNC_CHECK.name,
                self.decisions.size,
                self.decisions.rank,
            )
        seed = getattr(server_args, "random_seed", None)
        self.generator = torch.Generator().manual_seed(self.sync.seed(int(seed or 0)))  # accept draws on the host

    # -- what the scheduler reads ----------------------------------------------------------------
    @property
    def cache(self):
        return self.runner.token_to_kv_pool.cache

    @property
    def primary_draft_kv_pool(self):
        """What SGLang's PD path registers as the draft's pool: our draft state lives per request
        slot and travels with the target's rows (hook pd_request_state); it has no paged KV."""
        return DraftState(self)

    def _ensure_state(self):
        """The engine (draft cache, per-slot draft state) is sized like the target's cache, which
        SGLang allocates after this constructor."""
        if self.engine is not None:
            return
        if self.algo != DSPARK_ALGO:
            self.engine = NextNEngine(
                self.model,
                self.cache,
                self.topk,
                self.num_steps,
                self.num_draft_tokens,
                make_drafter,
                self.generator,
                device=self.device,
                sync=self.decisions,
            )
            logger.info(
                "dsv4_ascend NextN worker: %s, steps=%d topk=%d draft_tokens=%d, drafter=%s",
                "chain" if self.topk == 1 else "tree",
                self.num_steps,
                self.topk,
                self.num_draft_tokens,
                self.engine.drafter.name,
            )
            self._capture_graphs()
            if settings.NEXTN_SHAPE.get() == "adaptive":
                self._plan_shapes()
            self._guard()
            return
        planner = Planner(self.gamma, self.verify_mode)
        self.engine = SpecEngine(
            self.model,
            self.cache,
            make_drafter,
            self.generator,
            self.device,
            planner=planner,
            sync=self.decisions,
            gamma=self.gamma,
            topk=1,
            num_steps=self.gamma,
            num_draft_tokens=self.gamma + 1,
        )
        self._capture_graphs()
        if self.verify_mode == "adaptive":
            max_requests = min(self.cache.num_slots, 16)
            if self.sps_table:
                seed = cost_surface.load(self.sps_table, max_requests, max_requests * (self.gamma + 1))
            else:
                seed = measure_cost(
                    self.model.model,
                    self.cache,
                    self.gamma,
                    max_requests=max_requests,
                    agree=self.sync.any,
                    # the checkpoint's draft is timed too; the replay test drafter's cost is learned online
                    drafter=self.engine.drafter if self.engine.drafter.name == "dspark" else None,
                    graphs=self.engine.graphs,
                )
                seed = self.sync.broadcast(seed)  # timings differ per rank; rank 0's plans for all
                self._seed = seed
            planner.use(seed, agree=self.decisions.broadcast)  # refits agree over the deciding ranks
            if self.engine.graphs is not None:  # a budget is priced at its bucket's rows: filled up
                planner.pad = self.engine.graphs.rows_for
            logger.info(
                "dsv4_ascend DSpark round cost model (%s): %s",
                seed.source,
                cost_surface.describe(seed),
            )
        self._guard()
        native = self.model.cfg.dspark_block_size
        logger.info(
            "dsv4_ascend DSpark worker: gamma=%d (checkpoint native %s), verify=%s, drafter=%s, "
            "confidence temperatures: %s",
            self.gamma,
            native,
            self.verify_mode,
            self.engine.drafter.name,
            f"{self.sts_path} {self.model.dspark.sts}" if self.sts_path else "none (T = 1)",
        )

    def _guard(self):
        """Drafting only where it measured faster than plain decode steps (speculative/guard.py)."""
        if not settings.SPEC_GUARD.get():
            logger.info("dsv4_ascend speculation guard: off (%s=0)", settings.SPEC_GUARD.name)
            return
        max_requests = min(self.cache.num_slots, 16)
        plain, source = plain_round_seconds(
            self.model.model, self.cache, max_requests, agree=self.sync.any, graphs=self.engine.graphs, seed=self._seed
        )
        plain = self.sync.broadcast(plain)  # timings differ per rank; rank 0's for all
        guard = self.engine.guard = Guard(agree=self.decisions.broadcast, plain=plain)
        logger.info(
            "dsv4_ascend speculation guard: on (per batch size, no drafting where plain decode steps measure "
            "faster); plain step at startup, %s (the fastest at that many requests or more), ms %s",
            source,
            [(R, round(t * 1e3, 2)) for R, t in guard.plain],
        )

    def _plan_shapes(self):
        """NextN's round shape per round (speculative/shapes.py), seeded on this machine: the round
        without its draft over the rows a tree verifies, and each shape's draft stage."""
        eng = self.engine
        planner = ShapePlanner(self.topk, self.num_steps, self.num_draft_tokens, agree=self.decisions.broadcast)
        seed, drafts = measure_shapes(eng, planner, min(self.cache.num_slots, 16), agree=self.sync.any)
        seed, drafts = self.sync.broadcast((seed, drafts))  # timings differ per rank; rank 0's for all
        self._seed = seed
        planner.seed(seed, drafts)
        if eng.graphs is not None:
            planner.pad = eng.graphs.rows_for
        eng.shapes = planner
        logger.info(
            "dsv4_ascend NextN round shapes (%s=adaptive): %s; round without drafting %s; drafting ms %s",
            settings.NEXTN_SHAPE.name,
            planner.shapes,
            cost_surface.describe(seed),
            {s: [(R, round(t * 1e3, 2)) for R, t in pts] for s, pts in drafts.items()},
        )

    def _capture_graphs(self):
        """Under --enable-torch-compile on CPU: the target verify captured per batch size
        (speculative/graphs.py), each bucket as many rows as that many requests verify at most
        (every path of the widest tree, each from the root), and the draft: the DSpark block per
        batch size, NextN's draft steps per row bucket (as many rows as that many requests' leaf
        paths hold at the deepest step)."""
        from ..integration.server_defaults import spec_graph_sizes

        sizes = [b for b in spec_graph_sizes(self.server_args, self.device.type) if b <= self.cache.num_slots]
        if not sizes:
            return
        from .graphs import VerifyGraphs

        width = self.num_steps + 1
        per_request = width if self.topk == 1 else width * (self.num_draft_tokens - 1)
        layer_ids = getattr(self.engine.drafter, "layer_ids", ())
        context = kv_plan.graph_context(self.cache, settings.GRAPH_CONTEXT.get())
        rows = [b * per_request for b in sizes]
        graphs = VerifyGraphs(self.model.model, self.cache, width, rows, layer_ids, context=context)
        logger.info(
            "dsv4_ascend: capturing the target verify for %s requests (%s rows, %s, %s)",
            sizes,
            [b.rows for b in graphs.buckets],
            "any context" if context is None else f"contexts up to {context} tokens ({settings.GRAPH_CONTEXT.name})",
            graph_kind(),
        )
        graphs.capture()
        self.engine.graphs = graphs
        drafter = self.engine.drafter
        if drafter.name == "dspark":
            from .graphs import DraftGraphs

            trunk = self.model.model
            draft = DraftGraphs(drafter.net, drafter.ctx, self.gamma, sizes, trunk.embed, trunk.compute_logits)
            logger.info("dsv4_ascend: capturing the DSpark draft block for %s requests", sizes)
            draft.capture()
            self.engine.draft_graphs = draft
        elif drafter.name == "nextn" and self.num_steps > 1:
            from .graphs import NextNStepGraphs

            depth = self.num_steps - 1  # the deepest step's paths
            rows = [b * self.topk * depth for b in sizes]
            nextn, embed, dtype = self.model.nextn, self.model.model.embed, drafter.root_streams.dtype
            steps = NextNStepGraphs(nextn, drafter.draft_cache, embed, depth, rows, dtype)
            logger.info("dsv4_ascend: capturing the NextN draft steps for %s requests (%s rows)", sizes, rows)
            steps.capture()
            self.engine.draft_graphs = steps

    def prewarm_sampling(self):
        """SGLang's last startup call on a speculative worker, after the pools and backends exist:
        the engine is built here (for DSpark: the round cost model is measured here), so the first
        request does not pay for it."""
        result = super().prewarm_sampling()
        self._ensure_state()
        return result

    # SGLang's scheduler asks a DSPARK worker for these (log suffix, /get_server_info records)
    def block_accept_estimate_log_suffix(self) -> str:
        return self.stats.log_suffix()

    def dump_info_records(self):
        out = self.stats.snapshot()
        guard = getattr(self.engine, "guard", None)
        if guard is not None:
            out["guard_by_batch"] = guard.describe()
        # rounds that ran a captured forward (the rest ran eager: no bucket held them, or a tree)
        captured = {"verify": self.engine.graphs, "draft": self.engine.draft_graphs}
        out["captured_replays"] = {k: g.replays for k, g in captured.items() if g is not None}
        return out

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        self._ensure_state()
        # The local mode: under DP attention SGLang's `is_extend_in_batch` is true on every DP rank
        # when one of them prefills, while the others still have decode batches.
        if batch.forward_mode.is_extend():
            return self._prefill(batch)
        if batch.forward_mode.is_idle() or not batch.reqs:
            return self._idle(batch)
        return self._decode(batch)

    def _prefill(self, batch):
        out = self.target_worker.forward_batch_generation(batch)
        segments = self.runner.attn_backend.forward_metadata.segments
        restore = getattr(self.engine.drafter, "restore", None)
        for slot, length in self.runner.attn_backend.resumed:  # radix hits: the draft resumes too
            if restore is not None:
                restore(slot, length)
        sampled = out.next_token_ids.to("cpu").tolist()
        ids = batch.input_ids.to("cpu").tolist()
        # Draft row i reads token i+1: the next prompt token inside the chunk (or after it, for a
        # chunk that is not the last), the sampled token after the last prompt token.
        shifted, finals, off = [], [], 0
        for b, (req, seg) in enumerate(zip(batch.reqs, segments)):
            seq = list(req.origin_input_ids) + list(req.output_ids)
            end = seg.start + seg.length
            shifted += ids[off + 1 : off + seg.length] + [seq[end] if end < len(seq) else sampled[b]]
            off += seg.length
            if end >= len(seq):
                finals.append((b, off - 1))
        self.engine.extend(segments, torch.tensor(shifted, device=self.device), self.model.last_aux, None, finals)
        self.model.last_aux = None
        out.new_seq_lens = batch.seq_lens  # spec-v2 convention: the committed length
        out.next_draft_input = DSV4DraftInput(out.next_token_ids.to(torch.int64))
        if self.pd_prefill and self.algo != DSPARK_ALGO:
            # SGLang's PD prefill copies an EAGLE-family draft input's hidden states into the
            # transfer's metadata; ours travels in the request rows, so these only fill that field.
            mc = self.runner.model_config
            out.next_draft_input.hidden_states = torch.zeros(len(batch.reqs), mc.spec_hidden_size, dtype=mc.dtype)
        return out

    def _decode(self, batch):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        slots = batch.req_pool_indices.to("cpu").tolist()
        starts = batch.seq_lens.to("cpu").tolist()
        bonus = batch.spec_info.bonus_tokens.to("cpu").tolist()
        histories = [list(r.origin_input_ids) + list(r.output_ids) for r in batch.reqs]
        gens = [r.rid for r in batch.reqs]
        res = self.engine.round(slots, starts, bonus, _sampling_params(batch), histories, gens)
        self.stats.add(res)
        if self.algo != DSPARK_ALGO and self.stats.rounds % 32 == 0:
            # SGLang puts a worker's own figures into its decode log for DSpark only
            shapes = self.engine.shapes
            why = "" if shapes is None else f"; {shapes.describe()}"
            logger.info("dsv4_ascend NextN worker: %d rounds, %s%s", self.stats.rounds, self.stats.log_suffix(), why)
        stride = self.num_draft_tokens
        next_ids = [t for e in res.emitted for t in e + [0] * (stride - len(e))]
        accept = torch.tensor(res.accept_lens, dtype=torch.int32)
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None),
            next_token_ids=torch.tensor(next_ids, dtype=torch.int32),
            accept_lens=accept,
            new_seq_lens=batch.seq_lens + accept.to(batch.seq_lens),
            next_draft_input=DSV4DraftInput(torch.tensor(res.bonus, dtype=torch.int64, device=self.device)),
            speculative_num_draft_tokens=stride,
            can_run_cuda_graph=False,
            # verified rows per request (anchor included): SGLang's cap_lens, reported per request
            # as spec_cap_length / spec_cap_lens_histogram like its ragged-verify worker's
            cap_lens=(torch.tensor([t.n for t in res.trees], dtype=torch.int32) if self.algo == DSPARK_ALGO else None),
        )

    def _idle(self, batch):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        empty = torch.zeros(0, dtype=torch.int32)
        if self.model.layout.dp_size > 1:
            # DP attention: another DP rank runs a target forward this step (prefill or verify);
            # this one joins its MoE exchange with no rows.
            ids = torch.zeros(0, dtype=torch.long, device=self.device)
            self.model.model(ids, ids, [], self.cache)
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None),
            next_token_ids=empty,
            accept_lens=empty,
            new_seq_lens=batch.seq_lens,
            next_draft_input=DSV4DraftInput(torch.zeros(0, dtype=torch.int64, device=self.device)),
            speculative_num_draft_tokens=self.num_draft_tokens,
            can_run_cuda_graph=False,
        )


def _sampling_params(batch) -> list:
    """Per request: None for greedy, else the non-speculative sampler's parameters."""
    info = batch.sampling_info
    if info.is_all_greedy:
        return [None] * len(batch.reqs)
    temps = info.temperatures.view(-1).tolist()
    top_ps, top_ks, min_ps = info.top_ps.tolist(), info.top_ks.tolist(), info.min_ps.tolist()
    return [dict(temperature=t, top_p=p, top_k=k, min_p=m) for t, p, k, m in zip(temps, top_ps, top_ks, min_ps)]
