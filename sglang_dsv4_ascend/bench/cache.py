"""Cache bytes per token of context for DeepSeek-V4-Flash / -Pro, from the backend's allocations.

    python -m sglang_dsv4_ascend.bench cache --config flash|pro [--dtype bf16|fp32] [--spec-slack N]
                                             [--tp N --ep M] [--index-topk-freq 1,2,4]

With --tp (and --ep), also each rank's share under that layout (distributed/layout.py): its weight
bytes (the model built on the meta device with the rank's heads, groups, experts and shared-expert
slice), its cache bytes per token (the caches are replicated over attention TP: one shared KV head),
how many tokens of context fit next to the weights on a 64 GB device (a 910C die), and the bytes
each rank sends per decode token for the all-reduces our layout performs (attention wo_b in the model
dtype, MoE partial sums in fp32, ring all-reduce 2(n-1)/n of the tensor; the vocab-parallel
embedding's all-reduce and the head's logit all-gather, (n-1)/n of the logits, counted in fp32 as the
speculative engine gathers them; a served bf16 head sends half), beside what an EP
all-to-all dispatch + combine of the top-k copies would send. Arithmetic from shapes, not a timing.

For each context length the dsv4_ascend cache (`DSV4Cache`, exactly what the backend allocates) is
built for one request slot of that context on the `meta` device (shapes and bytes, no memory), and
its bytes are divided by the context. The baseline is a full MLA-style cache of the same model:
every layer keeps a 576-element latent (kv_lora 512 + rope 64) per token in the same dtype, as
DeepSeek-V3 / V3.2 do. DeepSeek reports about 10 % at 1M tokens for V4-Pro vs V3.2; this counts
only KV state (not V3.2's indexer keys), and includes our fixed per-request rings.
`pd_transfer_bytes`: what prefill/decode disaggregation moves for one request of that context
(the entry pages of its tokens and one request slot of every ring, as the pool describes them to
SGLang's transfer layer; no speculative draft).

With --index-topk-freq (IndexCache, config.index_topk_freq), also an `index_cache` block: for each
freq the same `DSV4Cache` allocation with the config's freq replaced (a CSA layer that reuses its
group source's top-k keeps no indexer key store and no indexer compressor rows), its bytes per
token at each context, and the bytes per token saved against freq 1 and their fraction of freq
1's bytes. The rows of the default output are freq 1 (the released config) and do not change.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import torch

from ..names import PAGE_SIZE

# Published architecture fields (see docs/dsv4_reference.md §1.1, §1.3). Only what shapes
# the caches matters here; the rest is filled so that the config validates.
_COMMON = dict(
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    sliding_window=128,
    index_n_heads=64,
    index_head_dim=128,
    vocab_size=129280,
    n_shared_experts=1,
    num_experts_per_tok=6,
    num_hash_layers=3,
    hc_mult=4,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    max_position_embeddings=1048576,
    swiglu_limit=10.0,
    rope_scaling={
        "type": "yarn",
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "beta_fast": 32,
        "beta_slow": 1,
    },
)
CONFIGS = {
    "flash": dict(
        _COMMON,
        hidden_size=4096,
        num_hidden_layers=43,
        num_attention_heads=64,
        q_lora_rank=1024,
        o_groups=8,
        o_lora_rank=1024,
        n_routed_experts=256,
        moe_intermediate_size=2048,
        index_topk=512,
        routed_scaling_factor=1.5,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0],
    ),
    "pro": dict(
        _COMMON,
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        q_lora_rank=1536,
        o_groups=16,
        o_lora_rank=1024,
        n_routed_experts=384,
        moe_intermediate_size=3072,
        index_topk=1024,
        routed_scaling_factor=2.5,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0],
    ),
}
for _c in CONFIGS.values():
    _c["num_nextn_predict_layers"] = len(_c["compress_ratios"]) - _c["num_hidden_layers"]

CONTEXTS = (8192, 32768, 131072, 1048576)
MLA_LATENT = 512 + 64


def pd_transfer_bytes(cache, context: int, page: int) -> int:
    """What prefill/decode disaggregation moves for one request of `context` tokens: the entry
    pages its tokens occupy (every store's page / ratio rows) and one request slot of every ring,
    as the pool describes them to SGLang's transfer layer (attention_backend/pool.py)."""
    per_page = sum(item for _, item in cache.page_stores(page))
    per_slot = sum(t[0].numel() * t.element_size() for t in cache.slot_tensors())
    return -(-context // page) * per_page + per_slot


def measure(name: str, dtype: torch.dtype, spec_slack: int = 0) -> dict:
    from sglang_dsv4_ascend.config import DSV4Config
    from sglang_dsv4_ascend.kvcache.cache import DSV4Cache

    cfg = DSV4Config.from_hf(CONFIGS[name])
    elt = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for ctx in CONTEXTS:
        cache = DSV4Cache(cfg, num_slots=1, max_context_len=ctx, spec_slack=spec_slack, dtype=dtype, device="meta")
        nb = cache.nbytes()
        mla = cfg.num_hidden_layers * MLA_LATENT * elt
        per_tok = nb["total"] / ctx
        rows.append(
            {
                "context": ctx,
                "dsv4_bytes_per_token": round(per_tok, 2),
                "mla_bytes_per_token": mla,
                "ratio_vs_mla": round(per_tok / mla, 4),
                "components_bytes_per_token": {k: round(v / ctx, 2) for k, v in nb.items() if k != "total"},
                "pd_transfer_bytes": pd_transfer_bytes(cache, ctx, PAGE_SIZE),
            }
        )
    return {
        "bench": "cache",
        "config": name,
        "dtype": str(dtype).replace("torch.", ""),
        "spec_slack": spec_slack,
        "layers": cfg.num_hidden_layers,
        "layer_kinds": {
            "swa_only": cfg.compress_ratios.count(0),
            "csa_c4": cfg.compress_ratios.count(4),
            "hca_c128": cfg.compress_ratios.count(128),
        },
        "sliding_window": cfg.sliding_window,
        "baseline": f"MLA-style latent cache, {MLA_LATENT} elements per token per layer, same dtype and layers",
        "source": "DSV4Cache allocation shapes on the meta device (what the dsv4_ascend backend allocates)",
        "results": rows,
    }


def index_cache(name: str, dtype: torch.dtype, freqs, spec_slack: int = 0) -> dict:
    """Cache bytes per token with the config's `index_topk_freq` replaced by each of `freqs`, and
    what each saves against freq 1 (IndexCache: reusing CSA layers allocate no indexer store)."""
    from sglang_dsv4_ascend.config import DSV4Config
    from sglang_dsv4_ascend.kvcache.cache import DSV4Cache

    base = DSV4Config.from_hf(CONFIGS[name])
    csa = [i for i in range(base.num_hidden_layers) if base.compress_ratios[i] == 4]

    def total(cfg, ctx):
        cache = DSV4Cache(cfg, num_slots=1, max_context_len=ctx, spec_slack=spec_slack, dtype=dtype, device="meta")
        return cache.nbytes()

    ref = {ctx: total(base, ctx)["total"] for ctx in CONTEXTS}
    rows = []
    for f in freqs:
        cfg = dataclasses.replace(base, index_topk_freq=f)
        computing = [i for i in csa if cfg.computes_topk(i)]
        per_ctx = []
        for ctx in CONTEXTS:
            nb = total(cfg, ctx)
            saved = ref[ctx] - nb["total"]
            per_ctx.append(
                {
                    "context": ctx,
                    "bytes_per_token": round(nb["total"] / ctx, 2),
                    "c4_index_bytes_per_token": round(nb["c4_index"] / ctx, 2),
                    "saved_bytes_per_token_vs_freq1": round(saved / ctx, 2),
                    "saved_fraction_vs_freq1": round(saved / ref[ctx], 4),
                }
            )
        rows.append(
            {
                "index_topk_freq": f,
                "indexer_layers": len(computing),
                "reusing_layers": len(csa) - len(computing),
                "results": per_ctx,
            }
        )
    return {
        "csa_layers": len(csa),
        "source": "DSV4Cache allocations on the meta device with config.index_topk_freq replaced; saved = freq 1's "
        "total bytes - freq N's (the reusing CSA layers' indexer key entries and indexer compressor rows)",
        "by_freq": rows,
    }


DEVICE_GB = 64  # HBM of one 910C die (one rank)


def per_rank(name: str, tp: int, ep: int, dtype: torch.dtype, context: int = 131072, dp: int = 1) -> dict:
    """One rank's weights, cache and traffic under --tp-size tp --ep-size ep, and with dp > 1
    --dp-size dp --enable-dp-attention (attention TP = tp / dp). Rank 0; every rank holds the same
    amount. Traffic: bytes one rank sends per decode step in which every DP rank decodes one token
    (ring all-reduce, 2 (n - 1) / n of the buffer)."""
    from sglang_dsv4_ascend.config import DSV4Config
    from sglang_dsv4_ascend.distributed.layout import Layout, layout_problems
    from sglang_dsv4_ascend.kvcache.cache import DSV4Cache
    from sglang_dsv4_ascend.models.trunk import DSV4Model

    cfg = DSV4Config.from_hf(CONFIGS[name])
    problems = layout_problems(cfg, tp, ep, dp, enable_dp_attention=dp > 1)
    if problems:
        raise ValueError("; ".join(problems))
    layout = Layout.for_flags(tp, ep, dp)
    model = DSV4Model(cfg, dtype=dtype, device="meta", layout=layout)
    weights = {"float": 0, "w8a8": 0}
    for n, p in model.named_parameters():
        b = p.numel() * p.element_size()
        weights["float"] += b
        # W8A8 (--quantization w8a8_ascend): the block linears in int8 plus one fp32 scale per row
        linear = p.dim() == 2 and n.startswith("layers.") and ".hc_" not in n and "gate.weight" not in n
        weights["w8a8"] += p.numel() + 4 * p.shape[0] if linear else b
    for buf in model.buffers():
        weights["float"] += buf.numel() * buf.element_size()
        weights["w8a8"] += buf.numel() * buf.element_size()
    cache = DSV4Cache(cfg, num_slots=1, max_context_len=context, dtype=dtype, device="meta")
    per_tok = cache.nbytes()["total"] / context
    elt, d, L, k = (
        torch.tensor([], dtype=dtype).element_size(),
        cfg.hidden_size,
        cfg.num_hidden_layers,
        cfg.num_experts_per_tok,
    )

    def ring(n):
        return 2 * (n - 1) / n if n > 1 else 0.0

    attn_tp = layout.attn_tp_size
    vocab_parallel = layout.vocab_parallel(cfg.vocab_size)
    budget = DEVICE_GB * 1e9
    return {
        "tp": tp,
        "ep": ep,
        "dp_attention": dp,
        "attn_tp": attn_tp,
        "moe_tp": tp // ep,
        "heads_per_rank": cfg.num_attention_heads // attn_tp,
        "experts_per_rank": cfg.n_routed_experts // ep,
        "vocab_rows_per_rank": len(layout.vocab_rows(cfg.vocab_size)),
        "weights_gb": {k_: round(v / 1e9, 2) for k_, v in weights.items()},
        "cache_bytes_per_token": round(per_tok, 1),
        "cache_context_for_bytes_per_token": context,
        "fits_on_64gb": {k_: v < budget for k_, v in weights.items()},
        "kv_tokens_that_fit_64gb": {k_: max(0, int((budget - v) / per_tok)) for k_, v in weights.items()},
        "sent_bytes_per_decode_token": {
            "attention_all_reduce": round(L * ring(attn_tp) * d * elt),
            # vocab-parallel embedding (one all-reduce) and head (logit columns all-gathered; fp32 counted)
            "embedding_all_reduce": round(ring(attn_tp) * d * elt) if vocab_parallel else 0,
            "logits_all_gather_fp32": round((attn_tp - 1) / attn_tp * cfg.vocab_size * 4) if vocab_parallel else 0,
            # the MoE input of every DP rank (distributed/dp_exchange.py: SUM_LEN all-reduce)
            "dp_gather_all_reduce": round(L * ring(tp) * dp * d * elt) if dp > 1 else 0,
            "moe_all_reduce_fp32": round(L * ring(tp) * dp * d * 4),
            "ep_all_to_all_dispatch_combine_reference": round(L * 2 * k * d * elt * (ep - 1) / ep) if ep > 1 else 0,
        },
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_dsv4_ascend.bench cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="flash")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--spec-slack", type=int, default=0, help="speculative rows reserved per ring")
    ap.add_argument("--tp", type=int, default=None, help="also report one rank's share under --tp-size N")
    ap.add_argument("--ep", type=int, default=1, help="with --tp: --ep-size M (M divides N)")
    ap.add_argument(
        "--dp",
        type=int,
        default=1,
        help="with --tp: --dp-size D --enable-dp-attention (D divides N; attention TP = N / D)",
    )
    ap.add_argument(
        "--index-topk-freq",
        default=None,
        help="comma-separated IndexCache freqs (e.g. 1,2,4): add an index_cache block of bytes per token and "
        "bytes saved vs freq 1",
    )
    a = ap.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    freqs = None
    if a.index_topk_freq is not None:
        try:
            freqs = [int(x) for x in a.index_topk_freq.split(",") if x.strip()]
        except ValueError:
            freqs = []
        if not freqs or min(freqs) < 1:
            ap.error(f"--index-topk-freq {a.index_topk_freq!r}: expected comma-separated positive integers")
    out = measure(a.config, dtype, a.spec_slack)
    if freqs is not None:
        out["index_cache"] = index_cache(a.config, dtype, freqs, a.spec_slack)
    if a.tp is not None or a.dp != 1:
        try:
            out["per_rank"] = per_rank(a.config, a.tp or 1, a.ep, dtype, dp=a.dp)
        except ValueError as e:
            ap.error(str(e))
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
