"""The SGLang adapter: `DeepseekV4ForCausalLM` as SGLang loads it (its `EntryClass`, found through
SGLANG_EXTERNAL_MODEL_PACKAGE). It wraps the trunk (trunk.py, the model itself in plain torch),
feeds it the dsv4_ascend backend's per-request segments and plan (batch.DSV4ForwardMetadata), puts
SGLang's LogitsProcessor on top, builds the draft a speculative worker asks for and loads the
weights SGLang hands it."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from ..batch import DSV4ForwardMetadata
from ..checkpoint import read_index
from ..config import DSV4Config
from ..distributed.layout import Layout, log_layout
from ..distributed.sharding import rank_part
from ..layers.vocab_parallel import GatheredHead
from ..names import DSPARK_ALGO, NEXTN_ALGOS, QUANT_METHOD
from ..quantization.w8a8 import (
    DraftView,
    apply_quant_description,
    draft_description,
    load_w8a8_weights,
    quantized_draft_layers,
    quantized_linear_count,
    w8a8_rank_part,
)
from .dspark import CONFIDENCE_BIAS, ConfidenceHead, DSparkDraft, load_dspark
from .dspark import PREFIX as DSPARK_PREFIX
from .nextn import PREFIX as NEXTN_PREFIX
from .nextn import NextN
from .trunk import DSV4Model
from .weights import iter_checkpoint, load_released_weights

logger = logging.getLogger("sglang_dsv4_ascend")
# which draft tensors ModelSlim's V4 recipe quantizes (quantization/w8a8.py V4_RECIPE)
DESCRIPTION_NOTE = {
    "dspark": "attention wq_a / wq_b / wkv, experts, main_proj; the rest float",
    "nextn": "attention wq_a / wq_b / wkv, experts; the rest float",
}


def _weight_files(model_path) -> dict | str | None:
    """{tensor name: file} from the checkpoint index, so loading errors can name the file."""
    if not model_path:
        return None
    index = read_index(model_path)
    return model_path if index is None else {k: os.path.join(model_path, v) for k, v in index.items()}


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__()
        from sglang.srt.layers.logits_processor import LogitsProcessor

        self.config = config
        self.cfg = DSV4Config.from_hf(_checkpoint_shapes(config))
        # This rank's heads and experts under --tp-size / --ep-size (distributed/layout.py).
        self.layout = Layout.from_sglang()
        log_layout(self.layout)
        self.model = DSV4Model(self.cfg, dtype=torch.get_default_dtype(), layout=self.layout)
        if self.cfg.index_topk_freq > 1:
            csa = [i for i, r in enumerate(self.cfg.compress_ratios) if r == 4]
            logger.info(
                "dsv4_ascend IndexCache: index_topk_freq=%d: CSA layers %s select their top-k, layers %s reuse "
                "their group's",
                self.cfg.index_topk_freq,
                [i for i in csa if self.cfg.computes_topk(i)],
                [i for i in csa if not self.cfg.computes_topk(i)],
            )
        self.quant_description = None
        if quant_config is not None:
            if quant_config.get_name() != QUANT_METHOD:
                raise ValueError(
                    f"sglang_dsv4_ascend DeepSeek-V4: --quantization {quant_config.get_name()!r} is "
                    "not supported; use a bf16 checkpoint or a ModelSlim W8A8 one with "
                    f"--quantization {QUANT_METHOD}"
                )
            self.quant_description = quant_config.description
            apply_quant_description(self.model, self.quant_description)
        # compute_logits returns the whole vocabulary on every rank (a vocab-parallel head gathers
        # over attention TP itself, layers/vocab_parallel.py): SGLang's gather stays off.
        self.logits_processor = LogitsProcessor(config, skip_all_gather=True)
        # the speculative engine's logits round as this processor's do (vocab_parallel.head_matmul)
        self.model.fp32_head = bool(self.logits_processor.use_fp32_lm_head)
        # Always through GatheredHead (its quant_method.apply is what SGLang's processor calls):
        # the served logits are then head_matmul's, rounded as the speculative engine's are,
        # on one rank too (an fp32 row rounds alike alone or in a batch: layers.Linear).
        object.__setattr__(self, "_logits_head", GatheredHead(self.model.head, self.layout))
        # The draft (NextN's mtp.0 or DSpark's mtp.0..2), built only when a speculative worker will
        # use it.
        kind = _draft_kind(self.cfg)
        self.nextn = NextN(self.cfg, dtype=torch.get_default_dtype()) if kind == "nextn" else None
        self.dspark = DSparkDraft(self.cfg, dtype=torch.get_default_dtype()) if kind == "dspark" else None
        # A W8A8 checkpoint's draft is W8A8 where its description quantizes mtp.* tensors, float
        # where it quantizes none (a user who quantized only the target). The view is not a
        # submodule: its blocks are already the draft's.
        object.__setattr__(self, "draft_view", None)
        if kind is not None and self.quant_description is not None:
            counts = {}
            if quantized_draft_layers(self.quant_description):
                blocks = self.dspark.mtp if self.dspark is not None else [self.nextn]
                view = DraftView(blocks, self.cfg, torch.get_default_dtype())
                apply_quant_description(view, draft_description(self.quant_description))
                object.__setattr__(self, "draft_view", view)
                counts = quantized_linear_count(view)
            logger.info(
                "dsv4_ascend %s draft: %s",
                kind,
                f"W8A8 ({counts.get('W8A8Linear', 0)} linears, {counts.get('W8A8Experts', 0)} routed-expert layers; "
                f"{DESCRIPTION_NOTE[kind]})"
                if counts
                else "float (the checkpoint's quant_model_description.json quantizes no mtp.* tensor)",
            )
        # Set by the speculative worker: the aux request of every forward ({"layer_ids": ...}: the
        # pre-head streams and those layers' streams are kept in `last_aux`, the draft's input).
        self.capture_aux = None
        self.last_aux = None

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, **kwargs):
        from sglang.srt.model_executor.forward_context import get_attn_backend

        backend = get_attn_backend()
        meta = backend.forward_metadata
        if meta is None:  # an idle DP-attention rank (SGLang drops the metadata): no rows of its own
            meta = DSV4ForwardMetadata(segments=[])
        plan = meta.plan if self.model.attention_impl == "batched" else None
        aux = dict(self.capture_aux) if self.capture_aux is not None else None
        # Under DP attention SGLang may append padding rows (to the largest DP rank, or a multiple
        # of the attention-TP size; an idle rank has only those): the model runs on the real rows,
        # its MoE on every DP rank's rows (distributed/dp_exchange.py), and the logits keep
        # SGLang's row count.
        rows = input_ids.shape[0]
        real = plan.T if plan is not None else sum(s.length for s in meta.segments)
        hidden = self.model(input_ids[:real], positions[:real], meta.segments, backend.cache, plan=plan, aux=aux)
        if real < rows:
            hidden = torch.cat([hidden, hidden.new_zeros(rows - real, hidden.shape[1])])
        self.last_aux = aux
        return self.logits_processor(input_ids, hidden, self._logits_head, forward_batch)

    def set_dspark_layers_to_capture(self, layer_ids):
        """SGLang's DSPARK setup asks the target for its feature layers. Our DSpark worker
        captures `dspark_target_layer_ids` itself (`capture_aux`); this only records what
        SGLang asked for."""
        self.sglang_capture_ids = tuple(layer_ids or ())

    def load_weights(self, weights):
        path = getattr(self.config, "_name_or_path", None)
        source = _weight_files(path)
        presliced = (
            self.layout.sharded
            and bool(path)
            and os.path.isdir(path)
            and any(f.endswith(".safetensors") for f in os.listdir(path))
        )
        if presliced:
            # Each rank reads only its part of the checkpoint (float or W8A8); SGLang's iterator,
            # which would read every tensor whole on every rank, is left unread.
            part = (
                rank_part(self.layout, self.cfg.n_routed_experts, self.cfg.o_groups)
                if self.quant_description is None
                else w8a8_rank_part(self.model)
            )
            weights = iter_checkpoint(path, skip=None, part=part)
        draft = []
        if self.nextn is not None:  # one pass over the checkpoint: set the draft's tensors aside
            weights = _divert(weights, NEXTN_PREFIX, draft)
        elif self.dspark is not None:
            weights = _divert(weights, DSPARK_PREFIX, draft)
        if self.quant_description is None:
            load_released_weights(self.model, weights, source=source, presliced=presliced)
        else:
            load_w8a8_weights(self.model, weights, self.quant_description, source=source, presliced=presliced)
        if self.dspark is not None and not any(item[0] == CONFIDENCE_BIAS for item in draft):
            old = self.dspark.mtp[-1].confidence_head.proj.weight  # the released heads have no bias
            self.dspark.mtp[-1].confidence_head = ConfidenceHead(old.shape[1], bias=False, device=old.device)
        if self.draft_view is not None:
            load_w8a8_weights(self.draft_view, draft, draft_description(self.quant_description), source=source)
        elif self.nextn is not None:
            load_released_weights(self.nextn, draft, source=source, prefix=NEXTN_PREFIX)
        elif self.dspark is not None:
            load_dspark(self.dspark, draft, source=source)


# SGLang's CPU model runner pads head counts and intermediate sizes that a TP size does not divide
# (configs/update_config.adjust_config_with_unaligned_cpu_tp) and keeps the checkpoint's values as
# original_*. Our layout splits the real shapes (whole output groups, whole experts) and refuses
# what it cannot split, so the model is built from the checkpoint's values.
_PADDED = {
    "num_attention_heads": "original_num_attention_heads",
    "num_key_value_heads": "original_total_num_kv_heads",
    "moe_intermediate_size": "original_moe_intermediate_size",
    "intermediate_size": "original_intermediate_size",
}


def _checkpoint_shapes(config):
    """`config` as the checkpoint wrote it (a copy when SGLang padded it)."""
    undo = {k: getattr(config, v) for k, v in _PADDED.items() if getattr(config, v, None) is not None}
    if not undo or all(getattr(config, k, None) == v for k, v in undo.items()):
        return config
    import copy

    config = copy.copy(config)
    for k, v in undo.items():
        setattr(config, k, v)
    return config


def _divert(weights, prefix: str, into: list):
    for item in weights:
        if item[0].startswith(prefix):
            into.append(item)
        else:
            yield item


def _draft_kind(cfg) -> str | None:
    """The draft a speculative worker will use: "nextn" for `--speculative-algorithm nextn/eagle`
    on a checkpoint with an MTP block, "dspark" for `dspark` on one with a DSpark draft."""
    try:
        from sglang.srt.runtime_context import get_spec

        algo = (get_spec().speculative_algorithm or "").upper()
    except ValueError:  # "config namespace 'spec' not published": outside a server, no worker asks
        return None
    if algo in NEXTN_ALGOS and cfg.num_nextn_predict_layers >= 1:
        return "nextn"
    if algo == DSPARK_ALGO and cfg.dspark_target_layer_ids:
        return "dspark"
    return None


EntryClass = [DeepseekV4ForCausalLM]
