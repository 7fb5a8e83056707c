"""DeepSeek-V4 configuration, read from either a raw `config.json` dict or the HF config object.

SGLang hands the model transformers' `DeepseekV4Config`, which folds the released fields into its own
(`compress_ratios` -> `layer_types`, `num_hash_layers` -> `mlp_layer_types`, rope -> `rope_parameters`
{"main", "compress"}); a raw `config.json` keeps the released names. `DSV4Config.from_hf` accepts both
and validates eagerly so a bad checkpoint fails at load with the field, the value and what was expected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

VALID_RATIOS = (0, 4, 128)
_LAYER_TYPE_RATIO = {"sliding_attention": 0, "compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
_MISSING = object()
_INDEXER_TENSOR = re.compile(r"layers\.(\d+)\.attn\.indexer\.")


@dataclass(frozen=True)
class RopeParams:
    """Interleaved partial RoPE on the last `dim` channels of a head.

    `yarn=True` only rescales frequencies (YaRN "NTK-by-parts"); `attention_factor` multiplies cos/sin
    as HF does, and is 1.0 for V4 (the official code applies no YaRN magnitude factor)."""

    theta: float
    dim: int
    yarn: bool = False
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float = 1.0


@dataclass(frozen=True)
class DSV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    qk_rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    compress_ratios: tuple  # main layers only, each in {0, 4, 128}
    hash_layers: tuple  # per main layer: routed by tid2eid[token] instead of top-k
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_main: RopeParams
    rope_compress: RopeParams
    scoring_func: str = "sqrtsoftplus"
    max_position_embeddings: int = 1048576
    num_nextn_predict_layers: int = 0
    draft_compress_ratios: tuple = ()
    dspark_block_size: int | None = None
    dspark_noise_token_id: int | None = None
    dspark_target_layer_ids: tuple | None = None
    dspark_markov_rank: int | None = None
    dspark_n_routed_experts: int | None = None
    dspark_num_experts_per_tok: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: Any = 1
    index_topk_freq: int = 1  # IndexCache: CSA layers per indexer top-k (upstream's field name)

    def __post_init__(self):
        _validate(self)

    # -- per-layer helpers ---------------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def rope_for(self, layer: int) -> RopeParams:
        """SWA-only layers use the plain `rope_theta` rope; layers with a compressor use the YaRN
        `compress_rope_theta` rope for every rope application in the layer (q, kv, entries, indexer)."""
        return self.rope_compress if self.compress_ratios[layer] else self.rope_main

    def topk_source(self, layer: int) -> int:
        """The CSA layer whose indexer top-k CSA layer `layer` attends with (IndexCache). CSA layers
        are taken in order in groups of `index_topk_freq`; a group's first layer scores and selects,
        the others reuse its selection. Entry j of every CSA layer summarises the same tokens
        4j..4j+3, so an entry number picked by one layer addresses the same span in another. The
        group counts CSA layers only (HCA and SWA layers have no indexer), as upstream's V4 rule
        `sparse_ordinal % index_topk_freq` does; freq 1 is every layer its own source."""
        csa = [i for i, r in enumerate(self.compress_ratios) if r == 4]
        c = csa.index(layer)
        return csa[c - c % self.index_topk_freq]

    def computes_topk(self, layer: int) -> bool:
        """Main layer `layer` has a lightning indexer of its own (a CSA layer that is its group's source)."""
        return self.compress_ratios[layer] == 4 and self.topk_source(layer) == layer

    def is_dropped_tensor(self, name: str) -> bool:
        """A checkpoint tensor this configuration does not load: the indexer of a CSA layer that
        reuses another's top-k (IndexCache), as vLLM drops them; the checkpoint stays as released."""
        m = _INDEXER_TENSOR.match(name)
        if m is None or self.index_topk_freq == 1:
            return False
        layer = int(m.group(1))
        return layer < self.num_hidden_layers and self.compress_ratios[layer] == 4 and not self.computes_topk(layer)

    @property
    def num_hash_layers(self) -> int:
        return sum(self.hash_layers)

    @classmethod
    def from_hf(cls, src: Any) -> "DSV4Config":
        """Build from a raw config.json dict or an HF/SGLang config object."""
        return cls(**_parse(src))


def _get(src, name, default=_MISSING):
    if isinstance(src, Mapping):
        value = src.get(name, _MISSING)
    else:
        value = getattr(src, name, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ValueError(f"DSV4 config: required field {name!r} is missing")
        return default
    return value


def _bad(name, value, expected):
    return ValueError(f"DSV4 config: {name}={value!r} is invalid; expected {expected}")


def _parse_ratios(src, n_layers: int, n_draft: int):
    ratios = _get(src, "compress_ratios", None)
    if ratios is not None:  # raw config.json (or SGLang's own config class)
        want = n_layers + n_draft
        if (
            not isinstance(ratios, (list, tuple))
            or len(ratios) != want
            or not all(isinstance(r, int) and not isinstance(r, bool) for r in ratios)
        ):
            raise _bad(
                "compress_ratios",
                ratios,
                f"a list of {want} integers (num_hidden_layers={n_layers} main-layer entries, each one of "
                f"{VALID_RATIOS}, then num_nextn_predict_layers={n_draft} draft entries, each 0)",
            )
        return tuple(ratios[:n_layers]), tuple(ratios[n_layers:])
    layer_types = _get(src, "layer_types", None)
    if layer_types is None:
        raise ValueError("DSV4 config: neither 'compress_ratios' nor 'layer_types' is present")
    rates = dict(_LAYER_TYPE_RATIO)
    rates.update(_get(src, "compress_rates", {}) or {})
    rates["sliding_attention"] = 0
    out = []
    for i, t in enumerate(layer_types[:n_layers]):
        if t not in rates:
            raise _bad(f"layer_types[{i}]", t, f"one of {sorted(rates)}")
        out.append(int(rates[t]))
    # transformers drops the draft entries of compress_ratios; V4 draft layers are always SWA-only.
    return tuple(out), (0,) * n_draft


def _parse_hash(src, n_layers: int):
    n_hash = _get(src, "num_hash_layers", None)
    if n_hash is None:
        n_hash = _get(src, "n_hash_layers", None)
    if n_hash is None and _get(src, "mlp_layer_types", None) is not None:
        types = list(_get(src, "mlp_layer_types"))[:n_layers]
        for i, t in enumerate(types):
            if t not in ("hash_moe", "moe"):
                raise _bad(f"mlp_layer_types[{i}]", t, "'hash_moe' or 'moe'")
        return tuple(t == "hash_moe" for t in types) + (False,) * (n_layers - len(types))
    n_hash = 3 if n_hash is None else int(n_hash)  # HF's default
    if not 0 <= n_hash <= n_layers:
        raise _bad("num_hash_layers", n_hash, f"0 <= num_hash_layers <= num_hidden_layers={n_layers}")
    return tuple(i < n_hash for i in range(n_layers))


def _rope_from_dict(d: Mapping, theta: float, dim: int) -> RopeParams:
    kind = d.get("rope_type", d.get("type", "default")) or "default"
    theta = float(d.get("rope_theta", theta))
    if kind == "default":
        return RopeParams(theta=theta, dim=dim)
    if kind != "yarn":
        raise _bad("rope_scaling.type", kind, "'yarn' or 'default'")
    return RopeParams(
        theta=theta,
        dim=dim,
        yarn=True,
        factor=float(_get(d, "factor", 0.0)),  # absent -> derived below; an explicit 0 is refused
        original_max_position_embeddings=int(_get(d, "original_max_position_embeddings")),
        beta_fast=float(_get(d, "beta_fast", 32.0)),
        beta_slow=float(_get(d, "beta_slow", 1.0)),
        truncate=bool(_get(d, "truncate", True)),
        # V4 forces 1.0 (HF does the same) instead of YaRN's 0.1*ln(factor)+1 magnitude factor.
        attention_factor=float(_get(d, "attention_factor", 1.0)),
    )


def _parse_rope(src, dim: int, max_pos: int):
    rope_theta = float(_get(src, "rope_theta", 10000.0))
    compress_theta = float(_get(src, "compress_rope_theta", 160000.0))
    rp = _get(src, "rope_parameters", None)
    if isinstance(rp, Mapping) and isinstance(rp.get("main"), Mapping) and isinstance(rp.get("compress"), Mapping):
        main, comp = rp["main"], rp["compress"]
    else:
        scaling = _get(src, "rope_scaling", None) or (rp if isinstance(rp, Mapping) else {})
        main = {"rope_type": "default", "rope_theta": rope_theta}
        comp = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor")}
        comp["rope_theta"] = compress_theta
    main_p = _rope_from_dict(main, rope_theta, dim)
    comp_p = _rope_from_dict(comp, compress_theta, dim)
    if comp_p.yarn and _get(comp, "factor", None) is None:  # HF: factor defaults to max_pos / original
        comp_p = RopeParams(**{**comp_p.__dict__, "factor": max_pos / comp_p.original_max_position_embeddings})
    return main_p, comp_p


def _parse(src) -> dict:
    n_layers = int(_get(src, "num_hidden_layers"))
    heads = int(_get(src, "num_attention_heads"))
    hidden = int(_get(src, "hidden_size"))
    head_dim = _get(src, "head_dim", None)
    if head_dim is None:
        if heads <= 0 or hidden % heads:
            raise _bad("hidden_size", hidden, f"divisible by num_attention_heads={heads} when head_dim is absent")
        head_dim = hidden // heads
    head_dim = int(head_dim)
    rope_dim = _get(src, "qk_rope_head_dim", None)
    if rope_dim is None:
        rope_dim = int(head_dim * float(_get(src, "partial_rotary_factor", 64 / 512)))
    n_draft = int(_get(src, "num_nextn_predict_layers", 0))
    ratios, draft_ratios = _parse_ratios(src, n_layers, n_draft)
    max_pos = int(_get(src, "max_position_embeddings", 1048576))
    rope_main, rope_comp = _parse_rope(src, int(rope_dim), max_pos)
    n_experts = int(_get(src, "n_routed_experts"))
    target_ids = _get(src, "dspark_target_layer_ids", None)
    topk_method = _get(src, "topk_method", "noaux_tc")
    if topk_method != "noaux_tc":
        raise _bad("topk_method", topk_method, "'noaux_tc' (bias-corrected top-k, no group limit)")
    return dict(
        vocab_size=int(_get(src, "vocab_size")),
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        qk_rope_head_dim=int(rope_dim),
        q_lora_rank=int(_get(src, "q_lora_rank")),
        o_groups=int(_get(src, "o_groups")),
        o_lora_rank=int(_get(src, "o_lora_rank")),
        compress_ratios=ratios,
        hash_layers=_parse_hash(src, n_layers),
        # Taken as written (0 is a value, refused below); absent: V4's 128 (older name window_size).
        sliding_window=int(_get(src, "sliding_window", _get(src, "window_size", 128))),
        index_n_heads=int(_get(src, "index_n_heads")),
        index_head_dim=int(_get(src, "index_head_dim")),
        index_topk=int(_get(src, "index_topk")),
        n_routed_experts=n_experts,
        n_shared_experts=int(_get(src, "n_shared_experts", 1)),
        num_experts_per_tok=int(_get(src, "num_experts_per_tok")),
        moe_intermediate_size=int(_get(src, "moe_intermediate_size")),
        routed_scaling_factor=float(_get(src, "routed_scaling_factor", 1.0)),
        swiglu_limit=float(_get(src, "swiglu_limit", 0.0)),
        hc_mult=int(_get(src, "hc_mult", 4)),
        hc_sinkhorn_iters=int(_get(src, "hc_sinkhorn_iters", 20)),
        hc_eps=float(_get(src, "hc_eps", 1e-6)),
        rms_norm_eps=float(_get(src, "rms_norm_eps", 1e-6)),
        rope_main=rope_main,
        rope_compress=rope_comp,
        scoring_func=str(_get(src, "scoring_func", "sqrtsoftplus")),
        max_position_embeddings=max_pos,
        num_nextn_predict_layers=n_draft,
        draft_compress_ratios=draft_ratios,
        dspark_block_size=_opt_int(_get(src, "dspark_block_size", None)),
        dspark_noise_token_id=_opt_int(_get(src, "dspark_noise_token_id", None)),
        dspark_target_layer_ids=tuple(int(i) for i in target_ids) if target_ids is not None else None,
        dspark_markov_rank=_opt_int(_get(src, "dspark_markov_rank", None)),
        dspark_n_routed_experts=_opt_int(_get(src, "dspark_n_routed_experts", None)),
        dspark_num_experts_per_tok=_opt_int(_get(src, "dspark_num_experts_per_tok", None)),
        bos_token_id=_opt_int(_get(src, "bos_token_id", None)),
        eos_token_id=_get(src, "eos_token_id", None),
        # Kept as given (validated below): `--json-model-override-args '{"index_topk_freq": 2}'`
        # sets it on any checkpoint.
        index_topk_freq=_get(src, "index_topk_freq", 1),
    )


def _opt_int(v):
    return None if v is None else int(v)


def _validate(c: DSV4Config) -> None:
    for name in (
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "head_dim",
        "q_lora_rank",
        "o_groups",
        "o_lora_rank",
        "sliding_window",
        "index_n_heads",
        "index_head_dim",
        "n_routed_experts",
        "moe_intermediate_size",
        "hc_sinkhorn_iters",
    ):
        v = getattr(c, name)
        if not isinstance(v, int) or v <= 0:
            raise _bad(name, v, "a positive integer")
    if len(c.compress_ratios) != c.num_hidden_layers:
        raise _bad("compress_ratios", list(c.compress_ratios), f"{c.num_hidden_layers} main-layer entries")
    for i, r in enumerate(c.compress_ratios):
        if r not in VALID_RATIOS:
            raise _bad(f"compress_ratios[{i}]", r, f"one of {VALID_RATIOS}")
    for i, r in enumerate(c.draft_compress_ratios):
        if r != 0:
            raise _bad(f"compress_ratios[{c.num_hidden_layers + i}] (draft layer)", r, "0 (draft layers are SWA-only)")
    if len(c.hash_layers) != c.num_hidden_layers:
        raise _bad("hash_layers", c.hash_layers, f"one flag per main layer ({c.num_hidden_layers})")
    if c.index_topk <= 0:
        raise _bad("index_topk", c.index_topk, "a positive integer")
    f = c.index_topk_freq
    if not isinstance(f, int) or isinstance(f, bool) or f < 1:
        raise _bad(
            "index_topk_freq",
            f,
            "a positive integer: 1 (every CSA layer selects its own top-k) or N (IndexCache: the first "
            "CSA layer of every N selects, the next N-1 reuse its top-k)",
        )
    if c.head_dim % 2 or not (0 < c.qk_rope_head_dim <= c.head_dim) or c.qk_rope_head_dim % 2:
        raise _bad("qk_rope_head_dim", c.qk_rope_head_dim, f"an even number in (0, head_dim={c.head_dim}]")
    if c.qk_rope_head_dim > c.index_head_dim:
        raise _bad("index_head_dim", c.index_head_dim, f">= qk_rope_head_dim={c.qk_rope_head_dim} (rope on its tail)")
    if c.num_attention_heads % c.o_groups:
        raise _bad("o_groups", c.o_groups, f"a divisor of num_attention_heads={c.num_attention_heads}")
    if c.hc_mult < 1:
        raise _bad("hc_mult", c.hc_mult, "an integer >= 1")
    if not 1 <= c.num_experts_per_tok <= c.n_routed_experts:
        raise _bad("num_experts_per_tok", c.num_experts_per_tok, f"1 <= k <= n_routed_experts={c.n_routed_experts}")
    if c.n_shared_experts < 0:
        raise _bad("n_shared_experts", c.n_shared_experts, "an integer >= 0")
    if c.scoring_func != "sqrtsoftplus":
        raise _bad("scoring_func", c.scoring_func, "'sqrtsoftplus' (the only DeepSeek-V4 router)")
    if c.swiglu_limit < 0:
        raise _bad("swiglu_limit", c.swiglu_limit, "a number >= 0 (0 disables the clamp)")
    if c.hc_eps < 0 or c.rms_norm_eps <= 0:
        raise _bad("rms_norm_eps" if c.rms_norm_eps <= 0 else "hc_eps", (c.rms_norm_eps, c.hc_eps), "positive eps")
    for name, rp in (("rope_parameters.main", c.rope_main), ("rope_parameters.compress", c.rope_compress)):
        if rp.theta <= 0:
            raise _bad(f"{name}.rope_theta", rp.theta, "a positive number")
        if rp.yarn and (rp.factor <= 0 or rp.original_max_position_embeddings <= 0):
            raise _bad(f"{name}.factor", rp.factor, "a positive YaRN factor and original_max_position_embeddings")
        if rp.yarn and not 0 < rp.beta_slow <= rp.beta_fast:
            raise _bad(f"{name}.beta_fast/beta_slow", (rp.beta_fast, rp.beta_slow), "0 < beta_slow <= beta_fast")
