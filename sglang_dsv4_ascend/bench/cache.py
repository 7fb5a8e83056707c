"""Cache bytes per token of context for DeepSeek-V4-Flash / -Pro, from the backend's allocations.

    python -m sglang_dsv4_ascend.bench cache --config flash|pro [--dtype bf16|fp32] [--spec-slack N]

For each context length the dsv4_ascend cache (`DSV4Cache`, exactly what the backend allocates) is
built for one request slot of that context on the `meta` device (shapes and bytes, no memory), and
its bytes are divided by the context. The baseline is a full MLA-style cache of the same model:
every layer keeps a 576-element latent (kv_lora 512 + rope 64) per token in the same dtype, as
DeepSeek-V3 / V3.2 do. DeepSeek reports about 10 % at 1M tokens for V4-Pro vs V3.2; this counts
only KV state (not V3.2's indexer keys), and includes our fixed per-request rings.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

# Published architecture fields (see docs/dsv4_reference.md §1.1, §1.3). Only what shapes
# the caches matters here; the rest is filled so that the config validates.
_COMMON = dict(num_key_value_heads=1, head_dim=512, qk_rope_head_dim=64, sliding_window=128,
               index_n_heads=64, index_head_dim=128, vocab_size=129280, n_shared_experts=1,
               num_experts_per_tok=6, num_hash_layers=3, hc_mult=4, rope_theta=10000.0,
               compress_rope_theta=160000.0, max_position_embeddings=1048576, swiglu_limit=10.0,
               rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1})
CONFIGS = {
    "flash": dict(_COMMON, hidden_size=4096, num_hidden_layers=43, num_attention_heads=64, q_lora_rank=1024,
                  o_groups=8, o_lora_rank=1024, n_routed_experts=256, moe_intermediate_size=2048,
                  index_topk=512, routed_scaling_factor=1.5,
                  compress_ratios=[0, 0] + [4, 128] * 20 + [4] + [0]),
    "pro": dict(_COMMON, hidden_size=7168, num_hidden_layers=61, num_attention_heads=128, q_lora_rank=1536,
                o_groups=16, o_lora_rank=1024, n_routed_experts=384, moe_intermediate_size=3072,
                index_topk=1024, routed_scaling_factor=2.5,
                compress_ratios=[128, 128] + [4, 128] * 29 + [4] + [0]),
}
for _c in CONFIGS.values():
    _c["num_nextn_predict_layers"] = len(_c["compress_ratios"]) - _c["num_hidden_layers"]

CONTEXTS = (8192, 131072, 1048576)
MLA_LATENT = 512 + 64


def measure(name: str, dtype: torch.dtype, spec_slack: int = 0) -> dict:
    from sglang_dsv4_ascend.attention_backend.cache import DSV4Cache
    from sglang_dsv4_ascend.config import DSV4Config

    cfg = DSV4Config.from_hf(CONFIGS[name])
    elt = torch.tensor([], dtype=dtype).element_size()
    rows = []
    for ctx in CONTEXTS:
        cache = DSV4Cache(cfg, num_slots=1, max_context_len=ctx, spec_slack=spec_slack, dtype=dtype, device="meta")
        nb = cache.nbytes()
        mla = cfg.num_hidden_layers * MLA_LATENT * elt
        per_tok = nb["total"] / ctx
        rows.append({
            "context": ctx,
            "dsv4_bytes_per_token": round(per_tok, 2),
            "mla_bytes_per_token": mla,
            "ratio_vs_mla": round(per_tok / mla, 4),
            "components_bytes_per_token": {k: round(v / ctx, 2) for k, v in nb.items() if k != "total"},
        })
    return {
        "bench": "cache",
        "config": name,
        "dtype": str(dtype).replace("torch.", ""),
        "spec_slack": spec_slack,
        "layers": cfg.num_hidden_layers,
        "layer_kinds": {"swa_only": cfg.compress_ratios.count(0), "csa_c4": cfg.compress_ratios.count(4),
                        "hca_c128": cfg.compress_ratios.count(128)},
        "sliding_window": cfg.sliding_window,
        "baseline": f"MLA-style latent cache, {MLA_LATENT} elements per token per layer, same dtype and layers",
        "source": "DSV4Cache allocation shapes on the meta device (what the dsv4_ascend backend allocates)",
        "results": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang_dsv4_ascend.bench cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", choices=sorted(CONFIGS), default="flash")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--spec-slack", type=int, default=0, help="speculative rows reserved per ring")
    a = ap.parse_args(argv)
    out = measure(a.config, torch.bfloat16 if a.dtype == "bf16" else torch.float32, a.spec_slack)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
