"""`DeepseekV4ForCausalLM` as SGLang loads it: the plain-torch trunk (dsv4_core) fed by the
dsv4_ascend backend's per-request segments, with SGLang's LogitsProcessor on top."""

from __future__ import annotations

import json
import os

import torch
from torch import nn

from ..config import DSV4Config
from .dsv4_core import DSV4Model
from .nextn import PREFIX as NEXTN_PREFIX
from .nextn import NextN
from .weights import load_released_weights


def _weight_files(model_path) -> dict | str | None:
    """{tensor name: file} from the checkpoint index, so loading errors can name the file."""
    if not model_path:
        return None
    idx = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            return {k: os.path.join(model_path, v) for k, v in json.load(f)["weight_map"].items()}
    return model_path


class DeepseekV4ForCausalLM(nn.Module):
    def __init__(self, config, quant_config=None, prefix: str = "", **kwargs):
        super().__init__()
        from sglang.srt.layers.logits_processor import LogitsProcessor

        self.config = config
        self.cfg = DSV4Config.from_hf(config)
        self.model = DSV4Model(self.cfg, dtype=torch.get_default_dtype())
        self.quant_description = None
        if quant_config is not None:
            if quant_config.get_name() != "w8a8_ascend":
                raise ValueError(f"sglang_dsv4_ascend DeepSeek-V4: --quantization {quant_config.get_name()!r} is "
                                 "not supported; use a bf16 checkpoint or a ModelSlim W8A8 one with "
                                 "--quantization w8a8_ascend")
            from ..quantization.w8a8 import apply_quant_description

            self.quant_description = quant_config.description
            apply_quant_description(self.model, self.quant_description)
        self.logits_processor = LogitsProcessor(config)
        # The NextN draft block (mtp.0), built only when a speculative worker will use it.
        self.nextn = NextN(self.cfg, dtype=torch.get_default_dtype()) if _wants_nextn(self.cfg) else None
        # Set by the speculative worker: keep the last forward's pre-head streams (NextN's input).
        self.capture_streams = False
        self.last_streams = None

    def forward(self, input_ids, positions, forward_batch, input_embeds=None, **kwargs):
        from sglang.srt.model_executor.forward_context import get_attn_backend

        backend = get_attn_backend()
        meta = backend.forward_metadata
        plan = meta.plan if self.model.attention_impl == "batched" else None
        aux = {} if self.capture_streams else None
        hidden = self.model(input_ids, positions, meta.segments, backend.cache, plan=plan, aux=aux)
        if aux is not None:
            self.last_streams = aux["streams"]
        return self.logits_processor(input_ids, hidden, self.model.head, forward_batch)

    def load_weights(self, weights):
        source = _weight_files(getattr(self.config, "_name_or_path", None))
        draft = []
        if self.nextn is not None:  # one pass over the checkpoint: set the draft's tensors aside
            weights = _divert(weights, NEXTN_PREFIX, draft)
        if self.quant_description is None:
            load_released_weights(self.model, weights, source=source)
        else:
            from ..quantization.w8a8 import load_w8a8_weights

            load_w8a8_weights(self.model, weights, self.quant_description, source=source)
        if self.nextn is not None:
            load_released_weights(self.nextn, draft, source=source, prefix=NEXTN_PREFIX)


def _divert(weights, prefix: str, into: list):
    for item in weights:
        if item[0].startswith(prefix):
            into.append(item)
        else:
            yield item


def _wants_nextn(cfg) -> bool:
    """A NextN draft is served: `--speculative-algorithm nextn/eagle` on a checkpoint with an MTP
    block (DSpark checkpoints also have mtp.*, and their own worker)."""
    try:
        from sglang.srt.runtime_context import get_spec

        algo = (get_spec().speculative_algorithm or "").upper()
    except ValueError:  # "config namespace 'spec' not published": outside a server, no worker asks
        return False
    from ..server_defaults import SPEC_ALGOS

    return algo in SPEC_ALGOS and cfg.num_nextn_predict_layers >= 1


EntryClass = [DeepseekV4ForCausalLM]
