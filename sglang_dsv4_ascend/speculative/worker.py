"""`--speculative-algorithm nextn` (SGLang's EAGLE family) for our DeepSeek-V4: chain (topk 1) and
tree (topk > 1) drafting with the checkpoint's NextN block, verify, lossless accept, KV commit.

Entered through SGLang's seam for out-of-tree platforms (`get_speculative_worker_cls`); the
scheduler is untouched and sees what it expects of a spec-v2 EAGLE worker: `GenerationBatchResult`
with `next_token_ids` (stride `speculative_num_draft_tokens`), `accept_lens` (bonus included),
`new_seq_lens` and an `EagleDraftInput` (subclass) carrying each request's bonus token.

One round for a request with committed length L (target and draft caches hold positions < L) and
bonus token b (the last sample, at position L, not yet in any cache):

1. draft: the NextN state left by the last draft extend (logits and output streams of its row
   L-1, which read (b, target streams at L-1)) gives the root's children; each further step runs
   the draft over every current leaf's path (one segment per leaf at start L, writes discarded)
   and extends the tree (speculative/tree.py, SGLang's EAGLE scheme);
2. verify: the target runs one segment per root-to-leaf path of the tree (start L, the path's
   tokens at L + depth), writes deferred. A node therefore sees exactly the committed history and
   its own ancestors: its SWA window along its path, the compressed entries its own path
   completes, indexer top-k of its own. Node i's logits come from its row in the first path that
   holds it. Rows cost sum(leaf depths + 1), the price of reusing the chain path unchanged;
3. accept (speculative/accept.py): greedy or lossless rejection sampling over the tree; the
   accepted path is a prefix of one leaf's path, and only that segment's prefix is stored
   (`cache.apply(pending, keep=...)`): nothing of a rejected node reaches any cache or compressor
   row;
4. draft extend: the NextN block reads (accepted tokens after b + the new bonus, target streams at
   the accepted rows) at positions L .. L' - 1 and stores them in its own SWA cache; its last row
   is the next round's draft state.

Prefill runs the target through SGLang's own worker (the model keeps its pre-head streams), then
the same draft extend over the chunk.

Limitations, each refused at startup or per request rather than served wrong: overlap scheduling
(declared off), grammar / logprobs / penalties / logit bias under speculation (request_guard).
"""

from __future__ import annotations

import json
import logging
import os

import torch
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.eagle_info import EagleDraftInput

from ..models.dsv4_core import Segment
from .accept import accept_batch
from .drafters import make_drafter

logger = logging.getLogger("sglang_dsv4_ascend")

EAGLE_NAMES = ("EAGLE", "NEXTN")


def _serves_dsv4() -> bool:
    from sglang.srt.runtime_context import get_server_args

    from ..registrations import DSV4_ARCHS

    path = os.path.join(get_server_args().model_path, "config.json")
    try:
        with open(path) as f:
            return (json.load(f).get("architectures") or [None])[0] in DSV4_ARCHS
    except (OSError, ValueError):
        return False


def worker_cls_for(algorithm: str):
    """Our worker for EAGLE / NEXTN on DeepSeek-V4; None (SGLang's own) otherwise."""
    if str(algorithm).upper() in EAGLE_NAMES and _serves_dsv4():
        return DSV4NextNWorker
    return None


class DSV4DraftInput(EagleDraftInput):
    """What travels with the batch between rounds: the bonus token of each request. The rest of
    the draft state is per request slot in the worker, so filtering and merging need only this."""

    def __init__(self, bonus_tokens: torch.Tensor):
        super().__init__(bonus_tokens=bonus_tokens, topk_p=bonus_tokens.new_zeros((len(bonus_tokens), 0)).float(),
                         topk_index=bonus_tokens.new_zeros((len(bonus_tokens), 0)), hidden_states=None)

    def filter_batch(self, new_indices, new_indices_cpu=None):
        self.bonus_tokens = self.bonus_tokens[new_indices]
        self.topk_p, self.topk_index = self.topk_p[new_indices], self.topk_index[new_indices]

    def merge_batch(self, spec_info):
        self.bonus_tokens = torch.cat([self.bonus_tokens, spec_info.bonus_tokens.to(self.bonus_tokens)])
        self.topk_p = self.topk_p.new_zeros((len(self.bonus_tokens), 0))
        self.topk_index = self.topk_index.new_zeros((len(self.bonus_tokens), 0))


class DSV4NextNWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id: int, nccl_port: int, target_worker):
        super().__init__()
        from sglang.srt.runtime_context import get_spec

        spec = get_spec()
        self.server_args = server_args
        self._target_worker = target_worker
        self._draft_worker = None
        self.topk = spec.speculative_eagle_topk or 1
        self.num_steps = spec.speculative_num_steps
        self.num_draft_tokens = spec.speculative_num_draft_tokens
        check_tree_shape(self.num_steps, self.topk, self.num_draft_tokens)
        runner = target_worker.model_runner
        self.runner = runner
        self.model = runner.model
        self.device = torch.device(runner.device)
        if getattr(self.model, "nextn", None) is None:
            raise ValueError("--speculative-algorithm nextn: the DeepSeek-V4 model has no NextN (mtp.0) block loaded")
        self.model.capture_streams = True
        self.draft_cache = None  # built with the target's pools (after this constructor)
        self.drafter = make_drafter(self)
        seed = getattr(server_args, "random_seed", None)
        self.generator = torch.Generator(device=self.device).manual_seed(int(seed or 0))
        logger.info("dsv4_ascend NextN worker: %s, steps=%d topk=%d draft_tokens=%d, drafter=%s",
                    "chain" if self.topk == 1 else "tree", self.num_steps, self.topk, self.num_draft_tokens,
                    self.drafter.name)

    # -- what the scheduler reads ----------------------------------------------------------------
    @property
    def cache(self):
        return self.runner.token_to_kv_pool.cache

    def _ensure_state(self):
        """The draft's SWA cache and per-slot draft state, sized like the target's cache."""
        if self.draft_cache is not None:
            return
        cache, cfg = self.cache, self.model.cfg
        self.draft_cache = self.model.nextn.make_cache(cache.num_slots, cache.max_context_len, cache.spec_slack,
                                                       device=self.device)
        self.root_logits = torch.zeros(cache.num_slots, cfg.vocab_size, dtype=torch.float32, device=self.device)
        self.root_streams = torch.zeros(cache.num_slots, cfg.hc_mult, cfg.hidden_size, dtype=self.model.model.dtype,
                                        device=self.device)

    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None, pp_proxy_tensors=None):
        self._ensure_state()
        if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
            return self._prefill(batch)
        if batch.forward_mode.is_idle() or not batch.reqs:
            return self._idle(batch)
        return self._decode(batch)

    # -- prefill -----------------------------------------------------------------------------------
    def _prefill(self, batch):
        out = self.target_worker.forward_batch_generation(batch)
        segments = self.runner.attn_backend.forward_metadata.segments
        streams = self.model.last_streams
        sampled = out.next_token_ids.to("cpu").tolist()
        ids = batch.input_ids.to("cpu").tolist()
        # Draft row i reads token i+1: the next prompt token inside the chunk (or after it, for a
        # chunk that is not the last), the sampled token after the last prompt token.
        shifted, finals = [], []
        off = 0
        for b, (req, seg) in enumerate(zip(batch.reqs, segments)):
            seq = list(req.origin_input_ids) + list(req.output_ids)
            end = seg.start + seg.length
            nxt = seq[end] if end < len(seq) else sampled[b]
            shifted += ids[off + 1: off + seg.length] + [nxt]
            off += seg.length
            if end >= len(seq):
                finals.append((b, off - 1))
        self.drafter.extend(segments, torch.tensor(shifted, device=self.device), streams, finals)
        out.new_seq_lens = batch.seq_lens  # spec-v2 convention: the committed length
        out.next_draft_input = DSV4DraftInput(out.next_token_ids.to(torch.int64))
        return out

    # -- decode: draft, verify, accept, commit, draft extend ------------------------------------
    def _decode(self, batch):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        slots = batch.req_pool_indices.to("cpu").tolist()
        starts = batch.seq_lens.to("cpu").tolist()
        bonus = batch.spec_info.bonus_tokens.to("cpu").tolist()
        trees = self.drafter.draft(batch, slots, starts, bonus)

        segs, ids, pos, node_rows, seg_of_leaf = [], [], [], [], []
        row = 0
        for slot, L, tree in zip(slots, starts, trees):
            first = {}
            leaf_seg = {}
            for path in tree.paths():
                leaf_seg[path[-1]] = len(segs)
                segs.append(Segment(slot, L, len(path)))
                for d, node in enumerate(path):
                    first.setdefault(node, row + d)
                ids += [tree.tokens[n] for n in path]
                pos += range(L, L + len(path))
                row += len(path)
            node_rows.append([first[i] for i in range(tree.n)])
            seg_of_leaf.append(leaf_seg)
        dev = self.device
        pending, aux = [], {}
        trunk = self.model.model
        hidden = trunk(torch.tensor(ids, device=dev), torch.tensor(pos, device=dev), segs, self.cache,
                       pending=pending, aux=aux)
        flat_rows = torch.tensor([r for rows in node_rows for r in rows], device=dev)
        logits = trunk.compute_logits(hidden[flat_rows])
        per_req = torch.split(logits, [t.n for t in trees])
        results = accept_batch(trees, list(per_req), _sampling_params(batch), self.generator)

        keep = [0] * len(segs)
        commit_rows, next_ids, accept_lens, new_bonus, ext_segs = [], [], [], [], []
        stride = self.num_draft_tokens
        for b, ((path, bonus_tok), tree) in enumerate(zip(results, trees)):
            leaf = next(leaf for leaf in tree.leaves() if tree.path(leaf)[: len(path)] == path)
            s = seg_of_leaf[b][leaf]
            keep[s] = len(path)
            seg_first = sum(x.length for x in segs[:s])
            commit_rows += range(seg_first, seg_first + len(path))
            emitted = [tree.tokens[n] for n in path[1:]] + [bonus_tok]
            next_ids += emitted + [0] * (stride - len(emitted))
            accept_lens.append(len(path))
            new_bonus.append(bonus_tok)
            ext_segs.append(Segment(slots[b], starts[b], len(path)))
            self.drafter.observe(b, path, tree)
        self.cache.apply(pending, keep=tuple(keep))

        # Draft extend over the accepted rows: row i reads token i+1 and the target's streams at i.
        shifted = []
        for b, (path, bonus_tok) in enumerate(results):
            shifted += [trees[b].tokens[n] for n in path[1:]] + [bonus_tok]
        commit = torch.tensor(commit_rows, device=dev)
        ends, acc = [], 0
        for s in ext_segs:
            acc += s.length
            ends.append((len(ends), acc - 1))
        self.drafter.extend(ext_segs, torch.tensor(shifted, device=dev), aux["streams"][commit], ends)

        accept = torch.tensor(accept_lens, dtype=torch.int32)
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None),
            next_token_ids=torch.tensor(next_ids, dtype=torch.int32),
            accept_lens=accept,
            new_seq_lens=batch.seq_lens + accept.to(batch.seq_lens),
            next_draft_input=DSV4DraftInput(torch.tensor(new_bonus, dtype=torch.int64, device=dev)),
            speculative_num_draft_tokens=stride,
            can_run_cuda_graph=False,
        )

    def _idle(self, batch):
        from sglang.srt.layers.logits_processor import LogitsProcessorOutput
        from sglang.srt.managers.utils import GenerationBatchResult

        empty = torch.zeros(0, dtype=torch.int32)
        return GenerationBatchResult(
            logits_output=LogitsProcessorOutput(next_token_logits=None), next_token_ids=empty,
            accept_lens=empty, new_seq_lens=batch.seq_lens,
            next_draft_input=DSV4DraftInput(torch.zeros(0, dtype=torch.int64, device=self.device)),
            speculative_num_draft_tokens=self.num_draft_tokens, can_run_cuda_graph=False)


def check_tree_shape(steps, topk, draft_tokens) -> None:
    """The final (SGLang-resolved) shape: steps drafts deep, topk children per leaf, draft_tokens
    verified nodes including the root."""
    if steps is None or steps < 1:
        raise ValueError(f"--speculative-num-steps {steps}: must be >= 1")
    if topk < 1:
        raise ValueError(f"--speculative-eagle-topk {topk}: must be >= 1 (1 = chain, > 1 = tree)")
    most = 1 + topk + (steps - 1) * topk * topk  # the root + every candidate EAGLE records
    if topk == 1 and draft_tokens != steps + 1:
        raise ValueError(f"--speculative-num-draft-tokens {draft_tokens}: a chain (topk 1) verifies "
                         f"steps + 1 = {steps + 1} tokens")
    if not 2 <= draft_tokens <= most:
        raise ValueError(f"--speculative-num-draft-tokens {draft_tokens}: with --speculative-num-steps {steps} and "
                         f"--speculative-eagle-topk {topk} it must be in [2, {most}] (root + recorded candidates)")


def _sampling_params(batch) -> list:
    """Per request: None for greedy, else the non-speculative sampler's parameters."""
    info = batch.sampling_info
    if info.is_all_greedy:
        return [None] * len(batch.reqs)
    temps = info.temperatures.view(-1).tolist()
    top_ps, top_ks, min_ps = info.top_ps.tolist(), info.top_ks.tolist(), info.min_ps.tolist()
    return [dict(temperature=t, top_p=p, top_k=k, min_p=m) for t, p, k, m in zip(temps, top_ps, top_ks, min_ps)]
