"""Each rank's coordinates and what DeepSeek-V4 does with them.

One `Layout` names a rank's place in every group the model uses, read once from SGLang's
parallel state (`from_sglang`) or given explicitly (tests, `doctor --ranks`, `bench cache`):

    attention TP  (attn_tp_rank / attn_tp_size): splits the q heads, the attention sinks and the
                  grouped output projection (wo_a by whole groups, or with more ranks than groups
                  each group's heads over tp / o_groups ranks; wo_b row-parallel + all-reduce over
                  the attention-TP group);
    attention DP  (dp_rank / dp_size, `--dp-size` with `--enable-dp-attention`): attention TP =
                  tp / dp, and each DP rank serves its own requests with its own caches; around
                  every MoE the DP ranks' tokens are gathered and the result scattered back
                  (distributed/dp_exchange.py), so the MoE layout below spans the whole TP group;
    MoE EP        (ep_rank / ep_size): each rank holds n_routed_experts / ep_size experts;
    MoE TP        (moe_tp_rank / moe_tp_size = tp_size / ep_size): splits each local expert's
                  intermediate dimension;
    TP            (tp_rank / tp_size): splits the shared expert's intermediate dimension; the
                  MoE partial sums (routed + shared) are reduced over this group.

Vocab-parallel over the attention-TP group (`vocab_parallel`: when that group has several ranks
and divides the vocabulary): the embedding and the LM head hold vocab / attn_tp rows each
(layers/vocab_parallel.py). Those ranks serve the same tokens, so a token's embedding row comes
from the one rank that holds it and an all-reduce of it and zeros is exact, and each rank's logit
columns are all-gathered: every rank then holds the same full logits, bit for bit. This saves
2 x vocab x d x (1 - 1 / attn_tp) per rank (about 2 GiB bf16 for Flash at TP 16).

Replicated on every rank, and why:
  * the single shared KV head (`wkv`, `kv_norm`), both compressors and the indexer: DeepSeek-V4
    attention is MQA, so every head reads the same key rows, entries and top-k; splitting them
    would only add an all-gather before every read. The caches are therefore the same size on
    every rank (as SGLang's MLA caches under TP);
  * `wq_a` / `q_norm` (the q latent feeds the indexer, which is replicated);
  * mHC (hc_* tensors: a few KB per layer) and the norms;
  * the router (gate weight, bias, tid2eid): routing is computed identically on every rank from
    the same all-reduced input, so no rank ever needs another's routing;
  * the draft models (NextN block, DSpark stages): every rank runs the whole draft on the same
    replicated inputs, so drafts and the decisions made from them are identical by construction.

With the all-reduced hidden state identical on every rank (a collective returns the same bits
everywhere), everything after the last reduction of a forward is computed from identical inputs.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

logger = logging.getLogger(__name__)


def sglang_parallel_state():
    """SGLang's parallel_state module once its groups exist; None in a single process without them
    (in-process tests, tools)."""
    try:
        from sglang.srt.distributed import parallel_state as ps

        ps.get_tp_group()
    except (AssertionError, ImportError, AttributeError):
        return None
    return ps


@dataclass(frozen=True)
class Layout:
    tp_rank: int = 0
    tp_size: int = 1
    attn_tp_rank: int = 0
    attn_tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    moe_tp_rank: int = 0
    moe_tp_size: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    global_rank: int = 0
    world_size: int = 1
    # Sums over the TP group (the MoE) and over the attention-TP group (the attention output), in
    # place or not; identity on one rank. Not part of equality. `attn_reduce` defaults to `reduce`
    # (without DP attention the two groups are the same).
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)
    attn_reduce: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)
    # DP attention: this forward's row count on every DP rank, in DP rank order, from each rank's
    # own count (a host all-gather over the TP group's CPU group). Not part of equality.
    gather_counts: Callable[[int], list] | None = field(default=None, compare=False, repr=False)
    # Concatenation along the last dimension over the attention-TP group (the vocab-parallel head).
    attn_gather: Callable[[torch.Tensor], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    @property
    def sharded(self) -> bool:
        return self.tp_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        if self.reduce is None:
            raise RuntimeError(f"Layout {self.describe()}: no reduce function set for a sharded forward")
        return self.reduce(x)

    def attn_all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.attn_tp_size == 1:
            return x
        reduce = self.attn_reduce or (self.reduce if self.dp_size == 1 else None)
        if reduce is None:
            raise RuntimeError(f"Layout {self.describe()}: no attention-TP reduce function set")
        return reduce(x)

    def attn_all_gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.attn_tp_size == 1:
            return x
        gather = self.attn_gather
        if gather is None:
            raise RuntimeError(f"Layout {self.describe()}: no attention-TP gather function set")
        return gather(x)

    def vocab_parallel(self, vocab_size: int) -> bool:
        """Whether the embedding and head are split by vocabulary rows over attention TP (else
        replicated: one rank, or a vocabulary the group does not divide)."""
        return self.attn_tp_size > 1 and vocab_size % self.attn_tp_size == 0

    def vocab_rows(self, vocab_size: int) -> range:
        """The vocabulary ids whose embedding and head rows this rank holds."""
        if not self.vocab_parallel(vocab_size):
            return range(vocab_size)
        per = vocab_size // self.attn_tp_size
        return range(self.attn_tp_rank * per, (self.attn_tp_rank + 1) * per)

    def experts(self, n_experts: int) -> range:
        """The global ids of the routed experts this rank holds (contiguous)."""
        per = n_experts // self.ep_size
        return range(self.ep_rank * per, (self.ep_rank + 1) * per)

    def describe(self) -> str:
        return (
            f"rank {self.global_rank}/{self.world_size}: tp {self.tp_rank}/{self.tp_size}, "
            f"attn_tp {self.attn_tp_rank}/{self.attn_tp_size}, dp {self.dp_rank}/{self.dp_size}, "
            f"moe_ep {self.ep_rank}/{self.ep_size}, moe_tp {self.moe_tp_rank}/{self.moe_tp_size}"
        )

    @classmethod
    def from_sglang(cls) -> "Layout":
        """This process's coordinates from SGLang's parallel state (one rank when it has none)."""
        ps = sglang_parallel_state()
        if ps is None or ps.get_tp_group().world_size == 1:
            return cls()
        tp = ps.get_tp_group()
        world = ps.get_world_group()
        attn_tp = ps.get_attn_tensor_model_parallel_world_size()
        return cls(
            tp_rank=tp.rank_in_group,
            tp_size=tp.world_size,
            attn_tp_rank=ps.get_attn_tensor_model_parallel_rank(),
            attn_tp_size=attn_tp,
            ep_rank=ps.get_moe_expert_parallel_rank(),
            ep_size=ps.get_moe_expert_parallel_world_size(),
            moe_tp_rank=ps.get_moe_tensor_parallel_rank(),
            moe_tp_size=ps.get_moe_tensor_parallel_world_size(),
            dp_rank=tp.rank_in_group // attn_tp,
            dp_size=tp.world_size // attn_tp,
            global_rank=world.rank_in_group,
            world_size=world.world_size,
            reduce=tp.all_reduce,
            attn_reduce=ps.get_attn_tp_group().all_reduce,
            attn_gather=ps.get_attn_tp_group().all_gather,
            gather_counts=_counts_over(tp, attn_tp) if tp.world_size > attn_tp else None,
        )

    @classmethod
    def for_flags(cls, tp_size: int, ep_size: int = 1, dp_size: int = 1, tp_rank: int = 0) -> "Layout":
        """The layout SGLang builds for `--tp-size/--ep-size/--dp-size` (DP attention: attention TP =
        tp / dp), for rank `tp_rank`, without any process group (doctor, bench cache, tests)."""
        moe_tp = tp_size // max(1, ep_size)
        attn_tp = tp_size // max(1, dp_size)
        return cls(
            tp_rank=tp_rank,
            tp_size=tp_size,
            attn_tp_rank=tp_rank % attn_tp,
            attn_tp_size=attn_tp,
            ep_rank=tp_rank // moe_tp,
            ep_size=ep_size,
            moe_tp_rank=tp_rank % moe_tp,
            moe_tp_size=moe_tp,
            dp_rank=tp_rank // attn_tp,
            dp_size=dp_size,
            global_rank=tp_rank,
            world_size=tp_size,
        )


def _counts_over(tp, attn_tp: int):
    """gather_counts over SGLang's TP group coordinator `tp`: every rank sends its row count; the
    attention-TP ranks of one DP group send the same one, so DP rank d's is rank d * attn_tp's."""

    def gather(n: int) -> list:
        mine = torch.tensor([int(n)], dtype=torch.int64)
        out = [torch.zeros_like(mine) for _ in range(tp.world_size)]
        torch.distributed.all_gather(out, mine, group=tp.cpu_group)
        return [int(out[d * attn_tp]) for d in range(tp.world_size // attn_tp)]

    return gather


def layout_problems(
    cfg, tp_size: int, ep_size: int = 1, dp_size: int = 1, enable_dp_attention: bool = False, draft: str | None = None
) -> list[str]:
    """Why DeepSeek-V4 `cfg` (a DSV4Config or HF config) cannot be split as the flags ask, one
    message per problem, each naming the flag and the supported values. `dp_size` counts only
    with `enable_dp_attention` (plain `--dp-size` runs independent replicas of the tp layout)."""
    out = []
    H, G = cfg.num_attention_heads, cfg.o_groups
    E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    shared = inter * (cfg.n_shared_experts or 0)

    def divisors(n, limit=64):
        return [k for k in range(1, min(n, limit) + 1) if n % k == 0]

    if tp_size < 1:
        return out + [f"--tp-size {tp_size}: must be >= 1"]
    attn_tp = tp_size
    if enable_dp_attention:
        if dp_size < 2 or tp_size % dp_size:
            return out + [
                f"--dp-size {dp_size} --enable-dp-attention (--attn-dp-size {dp_size}): DP attention needs a "
                f"DP size of 2 or more that divides --tp-size {tp_size} (attention TP = tp / dp); supported: "
                f"{[k for k in divisors(tp_size) if k > 1]}"
            ]
        attn_tp = tp_size // dp_size

    def attn_fits(k):
        return H % k == 0 and (G % k == 0 or k % G == 0)

    if not attn_fits(attn_tp):
        what = (
            f"--tp-size {tp_size}"
            if attn_tp == tp_size
            else f"--tp-size {tp_size} / --dp-size {dp_size} (attention TP {attn_tp})"
        )
        out.append(
            f"{what}: attention TP splits the {H} heads over the ranks with each output group "
            f"(o_groups {G}) on whole ranks or split evenly over several; it must divide {H} and divide or be "
            f"a multiple of {G}; supported attention TP sizes: {[k for k in divisors(H) if attn_fits(k)]}"
        )
    if ep_size < 1 or tp_size % ep_size:
        out.append(
            f"--ep-size {ep_size}: must divide --tp-size {tp_size} (SGLang's MoE EP group lives inside "
            f"the TP group); supported: {divisors(tp_size)}"
        )
    elif E % ep_size:
        out.append(
            f"--ep-size {ep_size}: {E} routed experts cannot be split evenly over {ep_size} ranks; "
            f"supported: {[k for k in divisors(E) if tp_size % k == 0]}"
        )
    else:
        moe_tp = tp_size // ep_size
        if inter % moe_tp:
            out.append(
                f"--tp-size {tp_size} --ep-size {ep_size}: each expert's intermediate size {inter} is split "
                f"over tp/ep = {moe_tp} ranks and must be divisible; raise --ep-size"
            )
    if shared and shared % tp_size:
        out.append(f"--tp-size {tp_size}: the shared expert's intermediate size {shared} must be divisible by it")
    return out


_LOGGED: set = set()


def log_layout(layout: Layout, what: str = "DeepSeek-V4") -> None:
    """Once per process: where this rank sits and what it holds."""
    key = (what, layout.describe())
    if key not in _LOGGED:
        _LOGGED.add(key)
        logger.info("dsv4_ascend %s layout: %s", what, layout.describe())
