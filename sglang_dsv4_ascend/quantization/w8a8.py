"""ModelSlim W8A8 checkpoints for the plain-torch DeepSeek-V4 trunk (`DSV4Model`): the W8A8 modules,
the checkpoint description, and the loader. Pure torch; no SGLang import here (the SGLang
QuantizationConfig wraps these pieces elsewhere).

A ModelSlim checkpoint is a HF folder plus `quant_model_description.json`: {tensor name: type} with
types "W8A8" (static per-tensor activations), "W8A8_DYNAMIC" (per-token dynamic activations),
"FLOAT" (kept in source precision), and metadata keys ("model_quant_type", "version", ...).
Per quantized linear `X` (docs/dsv4_reference.md §4.1):

    X.weight        int8 [N, K]          both    per-output-channel symmetric
    X.weight_scale  [N, 1] or [N]        both    s_w[n]
    X.weight_offset [N, 1] or [N]        both    0 (symmetric; optional here, must be 0)
    X.input_scale   [1]                  W8A8    per-tensor activation scale
    X.input_offset  [1]                  W8A8    activation zero point (integer-valued)
    X.quant_bias    int32 [N]            W8A8    -o_x * sum_k Wq[n, k] (+ folded float bias)
    X.deq_scale     [N] fp32 (int64 for fp16 models)  W8A8    s_x * s_w[n]

What ModelSlim quantizes in V4 (§4.2, `V4_RECIPE` below): W8A8_DYNAMIC for attention wq_a, wq_b,
wkv, indexer wq_b, every routed and shared expert w1/w2/w3, DSpark main_proj; float for wo_a, wo_b
(some checkpoints quantize wo_b: read the description), compressor / indexer-compressor wkv, wgate,
ape, norm, indexer weights_proj, router gate (+bias, tid2eid), embed, head, norms, hc_*, attn_sink.

How descriptions map onto `DSV4Model` (whose module names are the released names):
* `<p>.weight` W8A8 / W8A8_DYNAMIC where `<p>` is one of `layers.N.attn.{wq_a, wq_b, wkv, wo_b}`,
  `layers.N.attn.indexer.{wq_b, weights_proj}`, `layers.N.ffn.shared_experts.{w1, w2, w3}`: that
  nn.Linear becomes a `W8A8Linear` holding the checkpoint tensors under the same names.
* `layers.N.ffn.experts.E.{w1, w2, w3}.weight` W8A8_DYNAMIC (all E experts, all three): the layer's
  `MoE` becomes `W8A8MoE` (same gate and shared expert modules) whose `experts` is one
  `W8A8Experts` holding stacked tensors w13 [E, 2I, d] (w1 rows then w3 rows, as SGLang stacks
  them) and w2 [E, d, I]. DSV4Model stores experts as an nn.ModuleList of per-expert nn.Linear;
  stacking them is what the grouped matmul (npu_grouped_matmul) needs.
* Linears that DSV4Model reads through `.weight` instead of calling the module (attn.wo_a in the
  grouped low-rank output, compressor wkv/wgate, the router gate, head, embed) cannot be W8A8 here:
  a description quantizing them is refused with a message naming the tensor.
* `mtp.*` entries are the draft's (NextN's `mtp.0`, DSpark's `mtp.0..2`): the trunk skips them, and
  the adapter plans and loads them into a `DraftView` of the draft's blocks by the same rules (the
  draft's linears are module calls too, plus DSpark `main_proj` and NextN `e_proj` / `h_proj`). A
  description that quantizes no `mtp.*` tensor leaves the draft float beside a W8A8 target.
"""

from __future__ import annotations

import json
import os
import re
from typing import Iterable, Optional

import torch
from torch import nn

from .. import ops
from ..checkpoint import DESCRIPTION_FILE
from ..config import DSV4Config
from ..distributed.sharding import SKIP, _part, shard
from ..models.trunk import DSV4Model
from ..models.weights import iter_checkpoint
from ..ops import quant as Q

W8A8, W8A8_DYNAMIC, FLOAT = "W8A8", "W8A8_DYNAMIC", "FLOAT"
QUANT_TYPES = (W8A8, W8A8_DYNAMIC)
# Keys of quant_model_description.json that are not tensor names.
METADATA_KEYS = frozenset(
    {
        "model_quant_type",
        "version",
        "group_size",
        "kv_cache_type",
        "fa_quant_type",
        "reduce_quant_type",
        "ignore",
        "packed_modules_mapping",
        "quant_method",
        "metadata",
    }
)
DYNAMIC_SUFFIXES = ("weight", "weight_scale", "weight_offset")
STATIC_SUFFIXES = DYNAMIC_SUFFIXES + ("input_scale", "input_offset", "quant_bias", "deq_scale")

_BLOCK = r"(?:layers|mtp)\.\d+"
# The V4 ModelSlim recipe (§4.2): released linear-weight names -> which scheme family.
V4_RECIPE = {
    "dense": re.compile(rf"^{_BLOCK}\.(?:attn\.(?:wq_a|wq_b|wkv|indexer\.wq_b)|ffn\.shared_experts\.w[123])\.weight$"),
    "routed": re.compile(rf"^{_BLOCK}\.ffn\.experts\.\d+\.w[123]\.weight$"),
    "draft_proj": re.compile(r"^mtp\.\d+\.main_proj\.weight$"),
    "wo_b": re.compile(rf"^{_BLOCK}\.attn\.wo_b\.weight$"),  # float in the recipe, W8A8 in some checkpoints
}
# DSV4Model linears that are called as modules (so they can be swapped for W8A8Linear).
_SWAPPABLE = re.compile(
    rf"^{_BLOCK}\.(?:attn\.(?:wq_a|wq_b|wkv|wo_b|indexer\.(?:wq_b|weights_proj))"
    r"|ffn\.shared_experts\.w[123]|main_proj|e_proj|h_proj)$"
)
_EXPERT = re.compile(rf"^({_BLOCK}\.ffn)\.experts\.(\d+)\.(w[123])\.(\w+)$")


def _is_draft(name: str) -> bool:
    return name.startswith("mtp.")


class DraftView(nn.Module):
    """A draft's blocks under their checkpoint names (`mtp.N.*`: NextN's one block, or DSpark's
    three stages), so the W8A8 plan and loader read a draft as they read the trunk. The draft is
    replicated on every rank (no layout); the blocks are the draft's own modules, swapped in place."""

    def __init__(self, blocks, cfg, dtype):
        super().__init__()
        self.mtp = blocks if isinstance(blocks, nn.ModuleList) else nn.ModuleList(blocks)
        self.cfg, self.dtype = cfg, dtype


def draft_description(desc: dict) -> dict:
    """The `mtp.*` entries of a description (with its metadata): what a DraftView is planned from."""
    return {k: v for k, v in desc.items() if k in METADATA_KEYS or (isinstance(k, str) and _is_draft(k))}


def quantized_draft_layers(desc: dict) -> list:
    """The draft layers a description quantizes (empty: the draft is float beside a W8A8 target)."""
    return sorted(p for p in describe_scheme(draft_description(desc)))


def _skips(model: nn.Module, name: str) -> bool:
    """The trunk skips the draft's entries (the adapter loads them into a DraftView), and the
    indexer of a CSA layer that reuses another's top-k (IndexCache: config.is_dropped_tensor)."""
    if _is_draft(name):
        return not isinstance(model, DraftView)
    cfg = getattr(model, "cfg", None)
    return cfg is not None and not isinstance(model, DraftView) and cfg.is_dropped_tensor(name)


class W8A8Error(ValueError):
    """A ModelSlim checkpoint / description that does not fit the model; the message names the tensor."""


# ------------------------------------------------------------------------------------------------
# description


def read_quant_description(path: str) -> dict:
    """Load quant_model_description.json (a file, or the checkpoint dir holding it)."""
    file = os.path.join(path, DESCRIPTION_FILE) if os.path.isdir(path) else path
    with open(file) as f:
        desc = json.load(f)
    if not isinstance(desc, dict):
        raise W8A8Error(f"{file}: expected a JSON object {{tensor name: type}}, got {type(desc).__name__}")
    return desc


def is_modelslim_checkpoint(path: str) -> bool:
    """SGLang's own rule (ModelConfig._find_quant_modelslim_config): the file exists in the model dir."""
    return os.path.isfile(os.path.join(path, DESCRIPTION_FILE))


def tensor_entries(desc: dict) -> dict:
    """{tensor name: type} without metadata keys."""
    return {k: v for k, v in desc.items() if isinstance(k, str) and k not in METADATA_KEYS and isinstance(v, str)}


def describe_scheme(desc: dict) -> dict:
    """{layer prefix: 'W8A8' | 'W8A8_DYNAMIC'} for every quantized `<prefix>.weight`, checking that
    the layer's other entries carry the same type and that no type is unknown."""
    entries = tensor_entries(desc)
    layers = {}
    for name, typ in entries.items():
        if typ not in QUANT_TYPES and typ != FLOAT:
            raise W8A8Error(
                f"quant_model_description.json: {name!r} has type {typ!r}; this plugin supports "
                f"{W8A8!r}, {W8A8_DYNAMIC!r} and {FLOAT!r}"
            )
        if typ in QUANT_TYPES and name.endswith(".weight"):
            layers[name[: -len(".weight")]] = typ
    for name, typ in entries.items():
        prefix, _, suffix = name.rpartition(".")
        if suffix in STATIC_SUFFIXES and suffix != "weight" and typ in QUANT_TYPES:
            if layers.get(prefix) != typ:
                raise W8A8Error(
                    f"quant_model_description.json: {name!r} is {typ!r} but {prefix + '.weight'!r} is "
                    f"{entries.get(prefix + '.weight', 'absent')!r}"
                )
    return layers


# ------------------------------------------------------------------------------------------------
# modules


def _check_dtype(name, tensor, want, declared):
    ok = want(tensor.dtype) if callable(want) else tensor.dtype == want
    if not ok:
        wanted = getattr(want, "__doc__", None) if callable(want) else str(want)
        raise W8A8Error(
            f"tensor {name!r} is declared {declared} in {DESCRIPTION_FILE} but has dtype "
            f"{tensor.dtype}; expected {wanted}"
        )


def _float_dtype(d):
    """a floating dtype"""
    return d.is_floating_point


def _scale_dtype(d):
    """a floating dtype (or int64 deq format)"""
    return d.is_floating_point or d == torch.int64


def _vector(name, tensor, n, what):
    """[n] or [n, 1] -> [n]."""
    if tuple(tensor.shape) not in ((n,), (n, 1)):
        raise W8A8Error(f"tensor {name!r} has shape {tuple(tensor.shape)}; expected {what} [{n}] or [{n}, 1]")
    return tensor.reshape(n)


class W8A8Linear(nn.Module):
    """y = W8A8(x) for one ModelSlim linear (no bias: no V4 linear has one).

    scheme W8A8_DYNAMIC: (xq, s_tok) = dynamic_quant(x); y = quant_matmul(xq, Wq, weight_scale, s_tok)
    scheme W8A8 (static): xq = static_quant(x, input_scale, input_offset); y = quant_matmul(xq, Wq,
    deq_scale, bias=quant_bias). Output dtype = x's dtype. An (int8, scale) tuple input (activations
    quantized by an earlier fused kernel) skips the quantization and gives bf16, as in SGLang.

    Buffers use the checkpoint names (`weight`, `weight_scale`, ...), so `<prefix>.weight_scale`
    in the checkpoint is `<prefix>.weight_scale` in the model's state_dict. Scales are kept in fp32
    (the checkpoint's precision) unless `scale_dtype=torch.bfloat16` asks for SGLang's storage.
    `param_dtype` is SGLang's parameter dtype (bf16; fp16 for fp16 models): the static scheme rounds
    its activation-scale reciprocal in it, also when this module runs inside an fp32 DSV4Model, so
    the CPU run keeps the device's numerics.
    `process_weights_after_loading()` hands the weight to the kernel family's layout."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        scheme: str = W8A8_DYNAMIC,
        *,
        name: str = "",
        param_dtype=torch.bfloat16,
        scale_dtype=torch.float32,
        family: Optional[str] = None,
        device=None,
    ):
        super().__init__()
        if scheme not in QUANT_TYPES:
            raise W8A8Error(f"{name or 'W8A8Linear'}: scheme must be one of {QUANT_TYPES}, got {scheme!r}")
        self.in_features, self.out_features, self.scheme, self.name = in_features, out_features, scheme, name
        self.param_dtype, self.scale_dtype = param_dtype, scale_dtype
        self.kernels = ops.kernels(family)
        N, K = out_features, in_features
        self.register_buffer("weight", torch.zeros(N, K, dtype=torch.int8, device=device))
        self.register_buffer("weight_scale", torch.zeros(N, dtype=scale_dtype, device=device))
        self.register_buffer("weight_offset", torch.zeros(N, dtype=torch.float32, device=device))
        if scheme == W8A8:
            self.register_buffer("input_scale", torch.zeros(1, dtype=torch.float32, device=device))
            self.register_buffer("input_offset", torch.zeros(1, dtype=torch.float32, device=device))
            self.register_buffer("quant_bias", torch.zeros(N, dtype=torch.int32, device=device))
            self.register_buffer("deq_scale", torch.zeros(N, dtype=torch.float32, device=device))
        self._prepared = False

    @property
    def dynamic(self) -> bool:
        return self.scheme == W8A8_DYNAMIC

    def tensor_names(self, required_only: bool = False) -> tuple:
        names = DYNAMIC_SUFFIXES if self.dynamic else STATIC_SUFFIXES
        return tuple(n for n in names if not (required_only and n == "weight_offset"))

    def load_tensor(self, suffix: str, t: torch.Tensor, full_name: str) -> None:
        """Copy one checkpoint tensor `<prefix>.<suffix>`, checking dtype and shape."""
        N, K = self.out_features, self.in_features
        if suffix not in self.tensor_names():
            raise W8A8Error(
                f"unexpected tensor {full_name!r}: layer {self.name!r} is {self.scheme}, whose tensors "
                f"are {', '.join(self.tensor_names())}"
            )
        if suffix == "weight":
            _check_dtype(full_name, t, torch.int8, self.scheme)
            if tuple(t.shape) != (N, K):
                raise W8A8Error(f"tensor {full_name!r} has shape {tuple(t.shape)}, expected [{N}, {K}] from the config")
            self.weight.copy_(t)
        elif suffix == "weight_scale":
            _check_dtype(full_name, t, _float_dtype, self.scheme)
            self.weight_scale.copy_(_vector(full_name, t, N, "per-channel scale").to(self.scale_dtype))
        elif suffix == "weight_offset":
            off = _vector(full_name, t, N, "per-channel offset")
            if torch.any(off != 0):
                raise W8A8Error(
                    f"tensor {full_name!r} is nonzero: asymmetric int8 weights are not supported "
                    "(the NPU kernels ignore weight_offset)"
                )
            self.weight_offset.copy_(off.float())
        elif suffix in ("input_scale", "input_offset"):
            _check_dtype(full_name, t, _float_dtype, self.scheme)
            if t.numel() != 1:
                raise W8A8Error(f"tensor {full_name!r} has shape {tuple(t.shape)}; expected one per-tensor value [1]")
            getattr(self, suffix).copy_(t.reshape(1).float())
        elif suffix == "quant_bias":
            _check_dtype(full_name, t, torch.int32, self.scheme)
            self.quant_bias.copy_(_vector(full_name, t, N, "int32 bias"))
        elif suffix == "deq_scale":
            _check_dtype(full_name, t, _scale_dtype, self.scheme)
            v = _vector(full_name, t, N, "dequant scale")
            if v.dtype == torch.int64 and self.deq_scale.dtype != torch.int64:
                self.deq_scale = torch.zeros(N, dtype=torch.int64, device=self.weight.device)
            self.deq_scale.copy_(v.to(self.deq_scale.dtype))

    def process_weights_after_loading(self) -> None:
        if not self._prepared:
            self.weight = self.kernels.prepare_weight(self.weight)
            self._prepared = True

    def forward(self, x):
        k = self.kernels
        if isinstance(x, tuple):
            xq, s = x
            out_dtype = torch.bfloat16
            lead = xq.shape[:-1]
            xq, s = xq.reshape(-1, self.in_features), s.reshape(-1)
        else:
            out_dtype, lead = x.dtype, x.shape[:-1]
            x2 = x.reshape(-1, self.in_features)
            if self.dynamic:
                xq, s = k.dynamic_quant(x2)
            else:
                xq, s = k.static_quant(x2, self.input_scale, self.input_offset, self.param_dtype), None
        if self.dynamic or s is not None:
            y = k.quant_matmul(xq, self.weight, self.weight_scale, s, None, out_dtype)
        else:
            y = k.quant_matmul(xq, self.weight, self.deq_scale, None, self.quant_bias, out_dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, scheme={self.scheme}"


class W8A8Experts(nn.Module):
    """All routed experts of one MoE layer, W8A8_DYNAMIC, stacked for the grouped matmul:
    w13_weight int8 [E, 2I, d] (w1 = gate rows first, then w3 = up), w13_weight_scale [E, 2I],
    w2_weight int8 [E, d, I], w2_weight_scale [E, d]. forward runs `ops.quant.moe_w8a8`."""

    def __init__(
        self,
        num_experts: int,
        hidden: int,
        inter: int,
        limit: float,
        *,
        name: str = "",
        scale_dtype=torch.float32,
        family: Optional[str] = None,
        device=None,
        first: int = 0,
    ):
        super().__init__()
        self.num_experts, self.hidden, self.inter, self.limit, self.name = num_experts, hidden, inter, limit, name
        self.first = first  # global id of the first expert held here (expert parallel: this rank's range)
        self.kernels = ops.kernels(family)
        E, d, I = num_experts, hidden, inter
        self.register_buffer("w13_weight", torch.zeros(E, 2 * I, d, dtype=torch.int8, device=device))
        self.register_buffer("w13_weight_scale", torch.zeros(E, 2 * I, dtype=scale_dtype, device=device))
        self.register_buffer("w2_weight", torch.zeros(E, d, I, dtype=torch.int8, device=device))
        self.register_buffer("w2_weight_scale", torch.zeros(E, d, dtype=scale_dtype, device=device))
        self.loaded: set = set()
        self._prepared = False

    def required_names(self) -> list:
        return [
            f"{self.name}.{e}.{p}.{s}"
            for e in range(self.first, self.first + self.num_experts)
            for p in ("w1", "w2", "w3")
            for s in ("weight", "weight_scale")
        ]

    def load_tensor(self, e: int, proj: str, suffix: str, t: torch.Tensor, full_name: str) -> None:
        E, d, I = self.num_experts, self.hidden, self.inter
        if not 0 <= e - self.first < E:
            raise W8A8Error(
                f"tensor {full_name!r}: expert {e} is not held here (experts {self.first}..{self.first + E - 1})"
            )
        e -= self.first
        n, k = (d, I) if proj == "w2" else (I, d)
        rows = slice(0, I) if proj == "w1" else slice(I, 2 * I) if proj == "w3" else slice(0, d)
        w, s = (self.w2_weight, self.w2_weight_scale) if proj == "w2" else (self.w13_weight, self.w13_weight_scale)
        if suffix == "weight":
            _check_dtype(full_name, t, torch.int8, W8A8_DYNAMIC)
            if tuple(t.shape) != (n, k):
                raise W8A8Error(f"tensor {full_name!r} has shape {tuple(t.shape)}, expected [{n}, {k}] from the config")
            w[e, rows].copy_(t)
        elif suffix == "weight_scale":
            _check_dtype(full_name, t, _float_dtype, W8A8_DYNAMIC)
            s[e, rows].copy_(_vector(full_name, t, n, "per-channel scale").to(s.dtype))
        elif suffix == "weight_offset":
            if torch.any(_vector(full_name, t, n, "per-channel offset") != 0):
                raise W8A8Error(f"tensor {full_name!r} is nonzero: asymmetric int8 weights are not supported")
        else:
            raise W8A8Error(
                f"unexpected tensor {full_name!r}: routed experts are W8A8_DYNAMIC, whose tensors are "
                f"weight, weight_scale, weight_offset"
            )
        self.loaded.add(full_name)

    def process_weights_after_loading(self) -> None:
        if not self._prepared:
            self.w13_weight = self.kernels.prepare_weight(self.w13_weight)
            self.w2_weight = self.kernels.prepare_weight(self.w2_weight)
            self._prepared = True

    def forward(self, y: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """fp32 [T, d]: sum_k w_k * expert_{e_k}(y) through the W8A8 chain."""
        return Q.moe_w8a8(
            y,
            topk_ids,
            topk_weights,
            self.w13_weight,
            self.w13_weight_scale,
            self.w2_weight,
            self.w2_weight_scale,
            self.limit,
            y.dtype,
            ops=self.kernels,
        )

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, hidden={self.hidden}, inter={self.inter}, limit={self.limit}"


class W8A8MoE(nn.Module):
    """DeepSeek-V4 MoE with W8A8 routed experts: the float model's router (`gate`) and shared expert
    (`shared_experts`, whose linears may themselves be W8A8Linear) are kept; routed experts run the
    grouped W8A8 chain. Same call signature and output as `layers.moe.MoE`."""

    def __init__(self, moe: nn.Module, experts: W8A8Experts, shared_replicated: bool = False):
        super().__init__()
        self.gate = moe.gate
        self.experts = experts
        self.shared_experts = moe.shared_experts
        # Across ranks (distributed/): this rank's experts; copies routed elsewhere get ids outside
        # [0, E), which the grouped chain sorts past its groups (the rank holding theirs adds them).
        # A W8A8 shared expert is replicated (its per-token activation scale must see the whole
        # intermediate dimension) and added by rank 0.
        self.layout = getattr(moe, "layout", None)
        self.local = range(experts.first, experts.first + experts.num_experts)
        self.shared_replicated = shared_replicated

    def forward(self, y: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        ids, weights = self.gate(y, input_ids)
        sharded = self.layout is not None and self.layout.sharded
        if sharded:
            ids = ids - self.experts.first
        out = self.experts(y, ids, weights)
        if self.shared_experts is not None and not (self.shared_replicated and self.layout.tp_rank != 0):
            out += self.shared_experts(y).float()
        return (self.layout.all_reduce(out) if sharded else out).to(y.dtype)


# ------------------------------------------------------------------------------------------------
# applying a description to a DSV4Model


def _has_module(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def _model_desc(model) -> str:
    c = getattr(model, "cfg", None)
    return (
        (
            f" (config: {c.num_hidden_layers} layers, {c.n_routed_experts} routed experts, ratios "
            f"{list(c.compress_ratios)})"
        )
        if c is not None
        else ""
    )


def _local_experts(model: nn.Module, ffn: str, e: int = 0) -> range:
    """The routed experts `model` holds in MoE layer `ffn` (MoE and W8A8MoE both keep `local`;
    all of them on one rank)."""
    moe = _owner(model, ffn)
    if moe is None:
        return range(e, e + 1)  # reported as a missing module by the caller
    return moe.local


def plan_quantization(model: nn.Module, desc: dict) -> dict:
    """Validate a description against `model`; returns {"dense": {prefix: scheme}, "moe": {ffn prefix:
    scheme}}. Raises W8A8Error naming the entry for anything the model lacks or cannot quantize."""
    layers = describe_scheme(desc)
    state = model.state_dict(keep_vars=True)
    dense, moe_layers = {}, {}
    expert_entries: dict = {}
    for prefix, scheme in sorted(layers.items()):
        if _skips(model, prefix):
            continue
        m = _EXPERT.match(prefix + ".weight")
        if m:
            ffn, e, proj = m.group(1), int(m.group(2)), m.group(3)
            cfg = getattr(model, "cfg", None)
            if e not in _local_experts(model, ffn, e) and cfg is not None and e < cfg.n_routed_experts:
                expert_entries.setdefault(ffn, {})
                continue  # another EP rank's expert
            if not _has_module(model, f"{ffn}.experts.{e}.{proj}"):
                raise W8A8Error(
                    f"{DESCRIPTION_FILE} names {prefix + '.weight'!r} ({scheme}) but the model has no "
                    f"module {prefix!r}{_model_desc(model)}"
                )
            expert_entries.setdefault(ffn, {})[(e, proj)] = scheme
            continue
        if not _has_module(model, prefix):
            raise W8A8Error(
                f"{DESCRIPTION_FILE} names {prefix + '.weight'!r} ({scheme}) but the model has no "
                f"layer {prefix!r}{_model_desc(model)}"
            )
        if not _SWAPPABLE.match(prefix):
            raise W8A8Error(
                f"{DESCRIPTION_FILE} declares {prefix + '.weight'!r} as {scheme}, but DSV4Model reads "
                f"{prefix!r}'s weight directly (not through a linear call), so it cannot run W8A8; "
                "ModelSlim's V4 recipe keeps it float (dsv4_reference.md §4.2)"
            )
        if not isinstance(model.get_submodule(prefix), nn.Linear):
            raise W8A8Error(f"{DESCRIPTION_FILE}: {prefix!r} is not a linear layer")
        dense[prefix] = scheme
    for ffn, got in expert_entries.items():
        want = {(e, p) for e in _local_experts(model, ffn) for p in ("w1", "w2", "w3")}
        missing = sorted(want - set(got))
        if missing:
            shown = ", ".join(f"{ffn}.experts.{e}.{p}.weight" for e, p in missing[:4])
            raise W8A8Error(
                f"{DESCRIPTION_FILE} quantizes some routed experts of {ffn!r} but not all: {shown} "
                f"{'and more ' if len(missing) > 4 else ''}are not W8A8_DYNAMIC (the grouped matmul "
                "needs every expert of a layer in int8)"
            )
        static = sorted(k for k, v in got.items() if v != W8A8_DYNAMIC)
        if static:
            e, p = static[0]
            raise W8A8Error(
                f"{DESCRIPTION_FILE} declares {ffn}.experts.{e}.{p}.weight as {got[static[0]]}: routed "
                "experts support W8A8_DYNAMIC only (as SGLang's NPU int8 MoE method)"
            )
        moe_layers[ffn] = W8A8_DYNAMIC
    # Every other entry (FLOAT or a quantized layer's extra tensor) must name something real.
    for name, typ in tensor_entries(desc).items():
        if _skips(model, name):
            continue
        prefix, _, suffix = name.rpartition(".")
        if typ in QUANT_TYPES:
            m = _EXPERT.match(name)
            if (m and m.group(1) in moe_layers) or prefix in dense:
                continue
        if name not in state:
            raise W8A8Error(
                f"{DESCRIPTION_FILE} names tensor {name!r} ({typ}) which the model does not have{_model_desc(model)}"
            )
    return {"dense": dense, "moe": moe_layers}


def apply_quant_description(
    model: nn.Module, desc: dict, *, family: Optional[str] = None, scale_dtype=torch.float32
) -> dict:
    """Swap `model`'s linears / MoE layers for W8A8 modules per `desc` (see `plan_quantization`).
    Layers left FLOAT keep their float modules. Returns the plan. Weights still need loading."""
    plan = plan_quantization(model, desc)
    dev = next(model.parameters()).device
    param_dtype = getattr(model, "dtype", torch.bfloat16)
    param_dtype = param_dtype if param_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    layout = getattr(model, "layout", None)
    sharded = layout is not None and layout.sharded
    replicated_shared = set()
    for prefix, scheme in plan["dense"].items():
        parent_name, _, attr = prefix.rpartition(".")
        old = model.get_submodule(prefix)
        n_in, n_out = old.in_features, old.out_features
        if sharded and prefix.endswith("attn.wo_b"):
            raise W8A8Error(
                f"{DESCRIPTION_FILE} declares {prefix + '.weight'!r} as {scheme}: under --tp-size "
                f"{layout.tp_size} wo_b is split by its input columns, which a W8A8 activation scale "
                "cannot follow; serve this checkpoint with --tp-size 1 (ModelSlim's V4 recipe keeps wo_b float)"
            )
        if sharded and ".shared_experts." in prefix:  # replicated whole (see W8A8MoE)
            full = model.cfg.moe_intermediate_size * model.cfg.n_shared_experts
            n_in, n_out = (full, n_out) if attr == "w2" else (n_in, full)
            replicated_shared.add(parent_name.rpartition(".")[0])
        new = W8A8Linear(
            n_in,
            n_out,
            scheme,
            name=prefix,
            param_dtype=param_dtype,
            scale_dtype=scale_dtype,
            family=family,
            device=dev,
        )
        setattr(model.get_submodule(parent_name), attr, new)
    for ffn in plan["moe"]:
        parent_name, _, attr = ffn.rpartition(".")
        moe = model.get_submodule(ffn)
        if sharded and layout.moe_tp_size != 1:
            raise W8A8Error(
                f"W8A8 routed experts under --tp-size {layout.tp_size} need --ep-size {layout.tp_size}: "
                "splitting an expert's intermediate dimension would change its per-token activation scale"
            )
        first = next(iter(moe.experts.values()))
        experts = W8A8Experts(
            len(moe.experts),
            first.w1.in_features,
            first.w1.out_features,
            first.limit,
            name=f"{ffn}.experts",
            scale_dtype=scale_dtype,
            family=family,
            device=dev,
            first=moe.local.start,
        )
        setattr(
            model.get_submodule(parent_name), attr, W8A8MoE(moe, experts, shared_replicated=ffn in replicated_shared)
        )
    return plan


def _owner(model: nn.Module, prefix: str):
    try:
        return model.get_submodule(prefix)
    except AttributeError:
        return None


def load_w8a8_weights(model: nn.Module, weights: Iterable, desc: dict, source=None, presliced: bool = False) -> None:
    """Load a ModelSlim checkpoint's tensors into a model already passed through
    `apply_quant_description`. weights: (name, tensor[, file]) items: whole tensors, cut here to the
    model's layout, or (`presliced`) this rank's parts as `iter_checkpoint(part=w8a8_rank_part(..))`
    reads them. Errors name the tensor: missing
    tensors (e.g. a scale), dtypes that contradict the description (a float weight declared int8, an
    int8 weight declared FLOAT), shapes, unexpected tensors."""
    entries = tensor_entries(desc)
    state = model.state_dict(keep_vars=True)
    loaded = set()
    layout = getattr(model, "layout", None)
    sharded = layout is not None and layout.sharded and not presliced

    def where(file):
        return f" (file {file})" if file else (f" (in {source})" if isinstance(source, str) else "")

    with torch.no_grad():
        for item in weights:
            name, t = item[0], item[1]
            file = item[2] if len(item) > 2 else None
            if _skips(model, name):
                continue
            declared = entries.get(name, FLOAT)
            m = _EXPERT.match(name)
            if sharded:
                t = _rank_part(model, name, t, m, layout)
                if t is SKIP:
                    continue
            if m:
                moe = _owner(model, m.group(1))
                if isinstance(moe, W8A8MoE):
                    try:
                        moe.experts.load_tensor(int(m.group(2)), m.group(3), m.group(4), t, name)
                    except W8A8Error as err:
                        raise W8A8Error(f"{err}{where(file)}") from None
                    continue
            prefix, _, suffix = name.rpartition(".")
            owner = _owner(model, prefix)
            if isinstance(owner, W8A8Linear):
                try:
                    owner.load_tensor(suffix, t, name)
                except W8A8Error as err:
                    raise W8A8Error(f"{err}{where(file)}") from None
                loaded.add(name)
                continue
            target = state.get(name)
            if target is None:
                hint = ""
                if suffix in STATIC_SUFFIXES and suffix != "weight":
                    declared_w = entries.get(prefix + ".weight", "absent")
                    hint = f": {prefix + '.weight'!r} is {declared_w!r} in {DESCRIPTION_FILE}"
                raise W8A8Error(
                    f"unexpected tensor {name!r}{where(file)} with shape {tuple(t.shape)}: the model "
                    f"has no such parameter{hint}{_model_desc(model)}"
                )
            if declared in QUANT_TYPES:  # a quantized tensor whose layer was not swapped (cannot happen via plan)
                raise W8A8Error(f"tensor {name!r}{where(file)} is declared {declared} but its layer is float")
            if target.is_floating_point() and not t.is_floating_point():
                raise W8A8Error(
                    f"tensor {name!r}{where(file)} has dtype {t.dtype} but is declared {declared} in "
                    f"{DESCRIPTION_FILE} (a float tensor was expected)"
                )
            if tuple(t.shape) != tuple(target.shape):
                raise W8A8Error(
                    f"tensor {name!r}{where(file)} has shape {tuple(t.shape)}, expected "
                    f"{tuple(target.shape)} from the config"
                )
            if name.endswith("tid2eid"):
                n_exp = model.cfg.n_routed_experts
                if t.is_floating_point() or (t.numel() and (int(t.min()) < 0 or int(t.max()) >= n_exp)):
                    raise W8A8Error(f"tensor {name!r}{where(file)}: expected integer expert ids in [0, {n_exp})")
            target.copy_(t.to(device=target.device, dtype=target.dtype))
            loaded.add(name)

    missing = []
    for name, mod in model.named_modules():
        if isinstance(mod, W8A8Linear):
            missing += [f"{name}.{s}" for s in mod.tensor_names(required_only=True) if f"{name}.{s}" not in loaded]
        elif isinstance(mod, W8A8Experts):
            missing += [n for n in mod.required_names() if n not in mod.loaded]
    w8_names = {
        f"{n}.{b}"
        for n, mod in model.named_modules()
        if isinstance(mod, (W8A8Linear, W8A8Experts))
        for b, _ in mod.named_buffers(recurse=False)
    }
    missing += [n for n in state if n not in loaded and n not in w8_names]
    if missing:

        def why(n):
            p, _, s = n.rpartition(".")
            owner = _owner(model, p)
            if isinstance(owner, W8A8Linear):
                return f"{n!r} ({owner.scheme} layer {p!r} needs {s})"
            m = _EXPERT.match(n)
            if m:
                return f"{n!r} (W8A8_DYNAMIC routed expert needs {m.group(4)})"
            return repr(n)

        shown = ", ".join(why(n) for n in missing[:6])
        more = f" and {len(missing) - 6} more" if len(missing) > 6 else ""
        raise W8A8Error(f"missing tensor(s){where(None)}: {shown}{more}")
    shapes, device = set(), None
    for mod in model.modules():
        if isinstance(mod, (W8A8Linear, W8A8Experts)):
            mod.process_weights_after_loading()
            # a family whose GEMM is the reference's (reference, cpu) runs its fastest exact int8 method;
            # families with GEMMs of their own choose none
            if mod.kernels.quant_matmul is Q.quant_matmul:
                shapes |= (
                    {(mod.in_features, mod.out_features)}
                    if isinstance(mod, W8A8Linear)
                    else {(mod.hidden, 2 * mod.inter), (mod.inter, mod.hidden)}
                )
                device = next(mod.buffers()).device
    if shapes:
        # Choose each GEMM shape class's fastest exact int8 method now, not in the first requests.
        Q.plan_int8_methods(device, shapes)


def _rank_part(model, name, t, expert_match, layout):
    """This rank's part of a ModelSlim tensor: another EP rank's expert is SKIP; a W8A8 layer split
    by rows (attention wq_b) keeps its rows of the weight and of every per-row vector; a W8A8
    shared expert is whole (replicated); float tensors follow the float rules (sharding.shard)."""
    if _is_draft(name):
        return t  # the draft is replicated on every rank
    if expert_match is not None:
        return t if int(expert_match.group(2)) in _local_experts(model, expert_match.group(1)) else SKIP
    prefix, _, suffix = name.rpartition(".")
    owner = _owner(model, prefix)
    if isinstance(owner, W8A8Linear):
        if prefix.endswith("attn.wq_b") and suffix not in ("input_scale", "input_offset"):
            return _part(t, 0, layout.attn_tp_rank, layout.attn_tp_size)
        return t
    return shard(name, t, layout, model.cfg.n_routed_experts, model.cfg.o_groups)


def w8a8_rank_part(model: nn.Module):
    """For `models.weights.iter_checkpoint(part=...)` on a ModelSlim checkpoint: (name, safetensors
    slice) -> this rank's part of `model` (swapped by `apply_quant_description`, built for its
    layout) read from the file, or SKIP for another EP rank's expert, never read (`_rank_part`'s
    rules; load with `presliced=True`)."""

    def take(name, sl):
        part = _rank_part(model, name, sl, _EXPERT.match(name), model.layout)
        return part if part is SKIP or isinstance(part, torch.Tensor) else part[:]

    return take


def apply_modelslim_checkpoint(
    model: nn.Module, path: str, *, desc: Optional[dict] = None, family: Optional[str] = None, scale_dtype=torch.float32
) -> dict:
    """Swap `model`'s layers per the checkpoint's quant_model_description.json and load all its
    tensors (float ones too). Returns the plan {"dense": {...}, "moe": {...}}."""
    desc = read_quant_description(path) if desc is None else desc
    plan = apply_quant_description(model, desc, family=family, scale_dtype=scale_dtype)
    load_w8a8_weights(model, iter_checkpoint(path), desc, source=path)
    return plan


def load_w8a8_model_from_dir(
    path: str,
    dtype: torch.dtype = torch.bfloat16,
    device=None,
    family: Optional[str] = None,
    scale_dtype=torch.float32,
    layout=None,
):
    """config.json + ModelSlim safetensors -> an eval-mode DSV4Model with W8A8 modules (this rank's
    part under `layout`)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = DSV4Config.from_hf(json.load(f))
    model = DSV4Model(cfg, dtype=dtype, device=device, layout=layout)
    apply_modelslim_checkpoint(model, path, family=family, scale_dtype=scale_dtype)
    return model.eval()


def quantized_linear_count(model: nn.Module) -> dict:
    """{'W8A8Linear': n, 'W8A8Experts': n} (for reports and tests)."""
    out = {"W8A8Linear": 0, "W8A8Experts": 0}
    for m in model.modules():
        if isinstance(m, W8A8Linear):
            out["W8A8Linear"] += 1
        elif isinstance(m, W8A8Experts):
            out["W8A8Experts"] += 1
    return out
