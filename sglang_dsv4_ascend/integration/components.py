"""The SGLang registries the plugin fills: our model, attention backend, radix cache, server
defaults and quantization method. Each installer imports SGLang lazily (importing this package
must not import SGLang internals or torch_npu); `plugin.register()` runs them all in every SGLang
process, then installs the hooks (`hooks/`). `doctor` and the tests list them without running them.
"""

from __future__ import annotations

import logging
import os
import sys

from ..names import BACKEND_NAME, DSV4_ARCH, DSV4_ARCHS, MODELS_PACKAGE, QUANT_METHOD, RADIX_BACKEND
from .server_defaults import checkpoint_checks, dsv4_overrides, model_adjustments

logger = logging.getLogger("sglang_dsv4_ascend")


def _install_models():
    """Our DeepSeek-V4 wins in SGLang's ModelRegistry.

    SGLANG_EXTERNAL_MODEL_PACKAGE is SGLang's own seam for this (its classes win over the
    in-tree ones and the registry is read when the scheduler loads the model); it spares every
    process the ~10 s import of all in-tree models that touching ModelRegistry costs. Where the
    registry is already imported, or the variable names someone else's package, we write into
    ModelRegistry.models directly.
    """
    current = os.environ.get("SGLANG_EXTERNAL_MODEL_PACKAGE")
    if "sglang.srt.models.registry" not in sys.modules and current in (None, "", MODELS_PACKAGE):
        os.environ["SGLANG_EXTERNAL_MODEL_PACKAGE"] = MODELS_PACKAGE
        return
    from sglang.srt.models.registry import ModelRegistry

    from ..models.deepseek_v4 import DeepseekV4ForCausalLM

    for arch in DSV4_ARCHS:
        ModelRegistry.models[arch] = DeepseekV4ForCausalLM


def _install_attention_backend():
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    from ..attention_backend.backend import create_dsv4_ascend_backend

    register_attention_backend(BACKEND_NAME)(create_dsv4_ascend_backend)
    if BACKEND_NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([BACKEND_NAME])


def _install_radix_cache():
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from ..attention_backend.radix import create_dsv4_radix_cache

    if RADIX_BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(RADIX_BACKEND, create_dsv4_radix_cache)


def _install_model_override():
    import sglang.srt.arg_groups.overrides  # noqa: F401  (in-tree providers first: last one wins)
    from sglang.srt.arg_groups.model_override_base import register_model_override
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    for arch in DSV4_ARCHS:
        register_model_override(arch)(dsv4_overrides)
    register_resolution_hook("handle_model_source_paths")(checkpoint_checks)
    register_resolution_hook("handle_model_specific_adjustments")(model_adjustments)


def _install_quantization():
    """`w8a8_ascend` in SGLang's quantization table (a plain dict: no register function exists,
    so every process inserts it) and in the --quantization choices."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    from ..quantization.w8a8_ascend import W8A8AscendConfig

    QUANTIZATION_METHODS[QUANT_METHOD] = W8A8AscendConfig
    if QUANT_METHOD not in choices.QUANTIZATION_CHOICES:
        choices.add_quantization_method_choices([QUANT_METHOD])


# (name, installer) pairs for the components that exist.
COMPONENTS: list = [
    (f"model:{DSV4_ARCH}", _install_models),
    (f"attention_backend:{BACKEND_NAME}", _install_attention_backend),
    (f"model_override:{DSV4_ARCH}", _install_model_override),
    (f"radix_cache:{RADIX_BACKEND}", _install_radix_cache),
    (f"quantization:{QUANT_METHOD}", _install_quantization),
]
