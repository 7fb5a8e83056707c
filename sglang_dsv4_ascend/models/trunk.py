"""The DeepSeek-V4 trunk, the model itself, in plain PyTorch with no SGLang import: embed -> blocks
(mHC-wrapped attention + MoE) -> hc head -> norm -> head. Module and parameter names mirror the
released checkpoint names (`embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.hc_attn_fn`,
`layers.N.ffn.experts.E.w1.weight`, ...).

This is the trunk that the tests, the benchmarks, the drafts (nextn.py, dspark.py) and the
speculative engine run in process; models/deepseek_v4.py is the SGLang adapter that wraps it
(`DeepseekV4ForCausalLM`, SGLang's model class: the backend's segments in, SGLang's logits out).

A forward takes the tokens of several requests concatenated; each request is a `batch.Segment`
telling its cache slot, how many of its tokens the cache already holds (`start`) and how many are
new. Full prefill (start=0), chunked prefill, decode (length 1), speculative verify and mixtures of
them all go through the same path.
"""

from __future__ import annotations

import torch
from torch import nn

from .. import settings
from ..config import DSV4Config
from ..distributed.dp_exchange import DPExchange
from ..distributed.layout import Layout
from ..kvcache import plan as kv_plan
from ..kvcache.cache import DSV4Cache
from ..layers import RMSNorm
from ..layers.attention import Attention
from ..layers.mhc import hc_head, hc_post, hc_pre
from ..layers.moe import MoE
from ..layers.vocab_parallel import VocabParallelEmbedding, head_logits

# Released in fp32 and kept in fp32 whatever the model dtype (mHC, sinks, ape, router bias), plus
# the weights that are only ever used in fp32 (compressor projections, router): converted once at
# load (exact from bf16) instead of on every step.
_FP32_SUFFIXES = (
    "hc_attn_fn",
    "hc_attn_base",
    "hc_attn_scale",
    "hc_ffn_fn",
    "hc_ffn_base",
    "hc_ffn_scale",
    "hc_head_fn",
    "hc_head_base",
    "hc_head_scale",
    "attn_sink",
    ".ape",
    "gate.bias",
    "compressor.wkv.weight",
    "compressor.wgate.weight",
    "ffn.gate.weight",
)


def add_hc_head(module: nn.Module, cfg: DSV4Config, device=None) -> None:
    """The final mHC collapse's parameters (`hc_head_fn/base/scale`) on `module`."""
    d = cfg.hidden_size
    module.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * d, device=device))
    module.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult, device=device))
    module.hc_head_scale = nn.Parameter(torch.ones(1, device=device))


def cast_params(module: nn.Module, dtype) -> None:
    """Every parameter in `dtype`, except the released-fp32 ones (_FP32_SUFFIXES)."""
    for name, p in module.named_parameters():
        want = torch.float32 if name.endswith(_FP32_SUFFIXES) else dtype
        if p.dtype != want:
            p.data = p.data.to(want)


class Block(nn.Module):
    def __init__(self, cfg: DSV4Config, layer_id: int, dtype=None, device=None, layout: Layout | None = None):
        super().__init__()
        self.cfg = cfg
        n_mix, width = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.hidden_size
        for site in ("attn", "ffn"):
            self.register_parameter(f"hc_{site}_fn", nn.Parameter(torch.zeros(n_mix, width, device=device)))
            self.register_parameter(f"hc_{site}_base", nn.Parameter(torch.zeros(n_mix, device=device)))
            self.register_parameter(f"hc_{site}_scale", nn.Parameter(torch.ones(3, device=device)))
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.attn = Attention(cfg, layer_id, dtype, device, layout)
        self.ffn = MoE(cfg, layer_id, dtype, device, layout)

    def forward(self, streams, input_ids, positions, segments, cache, pending=None, plan=None, exchange=None):
        return self.mix(streams, input_ids, lambda x: self.attn(x, positions, segments, cache, pending, plan), exchange)

    def mix(self, streams, input_ids, attend, exchange=None):
        """The block around an attention `attend(x) -> out` (the cache-backed one when serving;
        the DSpark stages and the draft training forwards bring their own key sets). `exchange`
        (DP attention, distributed/dp_exchange.py): the MoE runs over every DP rank's tokens."""
        y, post, comb = hc_pre(streams, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        streams = hc_post(streams, attend(self.attn_norm(y)), post, comb)
        y, post, comb = hc_pre(streams, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        moe = self.ffn if exchange is None else exchange.around(self.ffn)
        return hc_post(streams, moe(self.ffn_norm(y), input_ids), post, comb)


class DSV4Model(nn.Module):
    def __init__(self, cfg: DSV4Config, dtype: torch.dtype = torch.float32, device=None, layout: Layout | None = None):
        """`layout`: this rank's place in the TP / EP groups (distributed/layout.py); the
        attention heads and experts it holds, the rest replicated. One rank by default."""
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.layout = layout or Layout()
        d = cfg.hidden_size
        # Split by vocabulary rows over attention TP when the layout allows (layers/vocab_parallel.py).
        V = len(self.layout.vocab_rows(cfg.vocab_size))
        self.embed = (
            VocabParallelEmbedding(cfg.vocab_size, d, self.layout, dtype=dtype, device=device)
            if self.layout.vocab_parallel(cfg.vocab_size)
            else nn.Embedding(V, d, dtype=dtype, device=device)
        )
        self.layers = nn.ModuleList(Block(cfg, i, dtype, device, self.layout) for i in range(cfg.num_hidden_layers))
        for i, block in enumerate(self.layers):  # IndexCache: a group's CSA layers share its source's picks
            if block.attn.reuses_topk:
                block.attn.topk_carry = self.layers[cfg.topk_source(i)].attn.topk_carry
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype, device=device)
        self.head = nn.Linear(d, V, bias=False, dtype=dtype, device=device)
        self.fp32_head = False  # the served head computes in fp32 (--enable-fp32-lm-head): set by the served model
        add_hc_head(self, cfg, device)
        cast_params(self, dtype)
        self.attention_impl = settings.ATTENTION.get()  # batched | segments (the per-segment definition)

    def make_cache(self, num_slots: int, max_context_len: int, spec_slack: int = 0, device=None):
        return DSV4Cache(self.cfg, num_slots, max_context_len, spec_slack, dtype=self.dtype, device=device)

    @torch.no_grad()
    def forward(
        self,
        input_ids,
        positions,
        segments,
        cache,
        pending: list | None = None,
        aux: dict | None = None,
        plan=None,
        exchange=None,
    ) -> torch.Tensor:
        """Hidden states [T, d] after the hc head and final norm (feed to `compute_logits`).

        input_ids/positions: [T], the segments' tokens concatenated in order; positions must be
        start..start+length-1 per segment. `pending`: if a list, cache writes are appended to it
        (`SegmentWrites`, apply with `cache.apply(pending, accepted)`) instead of stored.
        `aux`: if a dict, receives "streams" [T, hc_mult, d] (pre-head mHC streams, for NextN) and
        "layer_streams" ({layer id: its output streams} for the ids in aux["layer_ids"], DSpark's
        target features; only those are kept).
        `plan`: the batched path's geometry (kvcache/plan.py build_plan; built here from
        the segments when absent). With a bucket plan (graph capture) `segments` is ignored: the
        plan's own are checked. With `self.attention_impl = "segments"` every layer runs the
        per-segment definition instead (the oracle; SGLANG_DSV4_ATTENTION=segments).
        `exchange`: under DP attention, the `DPExchange` that gives every MoE the other DP ranks'
        tokens too (distributed/dp_exchange.py; built here from the layout when not given); this
        forward may then have no rows at all."""
        segments = layer_segments(input_ids, positions, segments, cache, pending, plan)
        if plan is None and self.attention_impl == "batched":
            plan = kv_plan.build_plan(segments, cache, device=input_ids.device)
        # The request boundary refuses such ids (integration/request_guard.py); this is the last line, without a
        # host sync: an error here instead of an out-of-bounds gather (on CPU a RuntimeError
        # naming the range; on an accelerator a device-side assertion).
        torch._assert_async(
            ((input_ids >= 0) & (input_ids < self.cfg.vocab_size)).all(),
            f"DSV4Model: input_ids outside the vocabulary [0, {self.cfg.vocab_size})",
        )
        streams = self.embed(input_ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        keep = set(aux.get("layer_ids", ())) if aux is not None else ()
        layer_streams = {}
        if exchange is None:  # DP attention: this forward's MoE sees every DP rank's rows
            exchange = DPExchange.for_forward(self.layout, input_ids.shape[0])
        if exchange is not None:
            exchange.bind(input_ids)
        for i, layer in enumerate(self.layers):
            streams = layer(streams, input_ids, positions, segments, cache, pending, plan, exchange)
            if i in keep:
                layer_streams[i] = streams
        if aux is not None:
            aux["streams"], aux["layer_streams"] = streams, layer_streams
        h = hc_head(streams, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg)
        return self.norm(h)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [T, vocab] (the whole vocabulary on every rank), rounded as the served head
        rounds them (layers/vocab_parallel.head_matmul; `fp32_head` mirrors --enable-fp32-lm-head)."""
        return head_logits(self.head, hidden, self.layout, self.cfg.vocab_size, self.fp32_head)


def layer_segments(input_ids, positions, segments, cache, pending, plan):
    """A forward's batch checked on the host (check_batch; with a bucket plan, the plan's own
    segments and its padded rows), and the segments its layers are given: none under a bucket
    plan, which is then all they read. A captured forward must not see the request list: a
    traced function would be specialised on its length; and its plan was checked when built."""
    static = plan is not None and plan.bucket is not None
    if not torch.compiler.is_compiling():
        check_batch(
            input_ids,
            positions,
            plan.segments if static else segments,
            cache,
            padded_to=plan.T if static else None,
            deferred=pending is not None,
        )
    return () if static else segments


def check_batch(input_ids, positions, segments, cache, padded_to=None, deferred=False) -> None:
    """`padded_to`: the rows of a static (bucketed) plan: input_ids/positions hold the segments'
    tokens first, then padding rows (any ids in range, positions ignored)."""
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError(
            f"input_ids and positions must be 1-D of equal length, got {tuple(input_ids.shape)} "
            f"and {tuple(positions.shape)}"
        )
    total = sum(s.length for s in segments)
    if total != input_ids.shape[0] and padded_to != input_ids.shape[0]:
        expect = f"{total}" if padded_to is None else f"{padded_to} (the plan's bucket)"
        raise ValueError(f"segments cover {total} tokens: input_ids must have {expect}, has {input_ids.shape[0]}")
    slots = [s.slot for s in segments]
    if len(set(slots)) != len(slots) and not deferred:
        raise ValueError(
            f"a slot appears twice in one forward that stores its writes: {slots} "
            "(only a forward with deferred writes, pending=[], may read one slot twice)"
        )
    # Checked where it costs nothing (CPU tensors); on a device it would be a host sync per forward.
    if positions.device.type == "cpu":
        expected = positions[:0]
        if segments:
            expected = torch.cat([s.start + torch.tensor(s.depths(), dtype=torch.long) for s in segments])
        if not torch.equal(positions[:total], expected):
            raise ValueError(
                "positions must be start..start+length-1 for each segment (start + depth for a tree), in segment order"
            )
    for s in segments:
        if not 0 <= s.slot < cache.num_slots or s.length <= 0 or s.start < 0:
            raise ValueError(f"bad segment {s}: need 0 <= slot < {cache.num_slots}, start >= 0, length > 0")
        if s.parents is not None:
            ok = len(s.parents) == len(s.past) + s.length and s.parents[0] == -1
            if not ok or any(not -1 <= p < i for i, p in enumerate(s.parents)):
                raise ValueError(
                    f"bad tree segment {s}: one parent per node (past ones first), parents[0] = -1, "
                    "each parent -1 (a root) or an earlier node"
                )
            if not deferred:
                raise ValueError(f"a tree segment's writes must be deferred (pending=[]): {s}")
        if s.start + s.length > cache.capacity:
            raise ValueError(f"segment {s} runs past max_context_len + spec_slack = {cache.capacity}")
