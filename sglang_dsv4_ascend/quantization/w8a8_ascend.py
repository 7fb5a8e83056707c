"""`--quantization w8a8_ascend`: ModelSlim W8A8 checkpoints for our DeepSeek-V4, as SGLang sees them.

SGLang has no register function for quantization methods: `QUANTIZATION_METHODS` is a plain dict
(also read by ModelConfig when it validates `--quantization`), so the plugin inserts this class in
every process and adds the CLI choice. ModelConfig turns a `quant_model_description.json` into
`quant_method="modelslim"` and then asks every method's `override_quantization_method`; we claim
it for DeepSeek-V4 descriptions (released tensor names) so `--quantization` can even be omitted.

Our DeepSeek-V4 model does not use SGLang's linear layers, so `get_quant_method` hands nothing to
SGLang layers; the model reads the description from this config and builds its own W8A8 modules
(quantization/w8a8.py, the bit rules in ops/quant.py).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from sglang.srt.layers.quantization.base_config import QuantizationConfig

from ..checkpoint import DESCRIPTION_FILE
from ..names import QUANT_METHOD

# Released DeepSeek-V4 tensor names: how a ModelSlim description of a V4 checkpoint looks.
_DSV4_MARKERS = (".attn.wq_a.", ".attn.wkv.", ".ffn.experts.", ".ffn.shared_experts.")


def is_dsv4_description(cfg: Optional[Dict[str, Any]]) -> bool:
    return bool(cfg) and any(m in k for k in cfg for m in _DSV4_MARKERS)


class W8A8AscendConfig(QuantizationConfig):
    def __init__(self, description: Dict[str, Any]):
        super().__init__()
        # The whole description (quantization/w8a8.py separates tensor entries from bookkeeping
        # keys such as model_quant_type); SGLang's own "quant_method" marker is not ModelSlim's.
        self.description = {k: v for k, v in description.items() if k != "quant_method"}

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> List[torch.dtype]:
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 0

    @staticmethod
    def get_config_filenames() -> List[str]:
        return [DESCRIPTION_FILE]

    @classmethod
    def from_config(cls, config: Dict[str, Any]) -> "W8A8AscendConfig":
        return cls(config)

    @classmethod
    def override_quantization_method(cls, hf_quant_cfg, user_quant) -> Optional[str]:
        if not isinstance(hf_quant_cfg, dict) or hf_quant_cfg.get("quant_method") != "modelslim":
            return None
        if user_quant == QUANT_METHOD or (user_quant in (None, "modelslim") and is_dsv4_description(hf_quant_cfg)):
            return QUANT_METHOD
        return None

    def get_quant_method(self, layer: torch.nn.Module, prefix: str):
        return None

    def get_scaled_act_names(self) -> List[str]:
        return []
