"""What `register()` installs: the components that exist, and the hooks they need.

Kept apart from plugin.py so that `doctor` and the tests can list them without running them.
Each installer imports SGLang lazily: importing this package must not import SGLang internals or
torch_npu. Every hook is documented in patches/README.md.
"""

from __future__ import annotations

import logging
import os
import sys

from .compat import Hook

logger = logging.getLogger("sglang_dsv4_ascend")

DSV4_ARCHS = ("DeepseekV4ForCausalLM",)
BACKEND_NAME = "dsv4_ascend"
MODELS_PACKAGE = "sglang_dsv4_ascend.models"
# On CPU (RAM shared with everything else) bound the request slots and the context: SGLang's
# req_to_token keeps a context-wide row per slot (1M positions for DeepSeek-V4) and each slot
# carries fixed rings. User flags still win.
CPU_DSV4_MAX_RUNNING_REQUESTS = 16


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

    from .models.deepseek_v4 import DeepseekV4ForCausalLM

    for arch in DSV4_ARCHS:
        ModelRegistry.models[arch] = DeepseekV4ForCausalLM


def _install_attention_backend():
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    from .attention_backend.backend import create_dsv4_ascend_backend

    register_attention_backend(BACKEND_NAME)(create_dsv4_ascend_backend)
    if BACKEND_NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([BACKEND_NAME])


def _dsv4_overrides(server_args, hf_config) -> dict:
    """Server defaults for DeepSeek-V4 with our backend; runs after SGLang's own DSV4 provider
    (registered later, so it wins) and replaces its `dsv4` backend and page size."""
    from sglang.srt.arg_groups.model_override_base import resolving_view

    cfg = resolving_view(server_args)
    out = {
        "attention_backend": BACKEND_NAME,
        "prefill_attention_backend": BACKEND_NAME,
        "decode_attention_backend": BACKEND_NAME,
        "page_size": 128,
        # Our cache keeps DSV4 state per request slot; SGLang's hybrid-SWA pools would size and
        # evict a second, unused copy.
        "disable_hybrid_swa_memory": True,
    }
    if not cfg.disable_radix_cache:
        # The radix tree shares token slots between requests, but DSV4 state (SWA ring,
        # compressor rows, compressed entries) lives per request slot and would not come along:
        # a prefix hit would attend to another request's (or no) history. Off until the cache
        # can snapshot per-prefix state.
        logger.info("dsv4_ascend: radix (prefix) cache disabled for DeepSeek-V4: its per-request "
                    "compressor and window state is not shared through the radix tree yet")
        out["disable_radix_cache"] = True
    return out


def _model_adjustments(server_args, previous):
    """After SGLang's model-specific step: bound request slots and context on the CPU reference.

    The model-override gate does not accept these two fields, so they go through SGLang's
    resolution-hook seam instead. User flags win (only unset fields are declared).
    Speculative decoding for DeepSeek-V4 is refused up front, naming the flag, rather than failing
    deep inside SGLang's own DSV4 workers."""
    from sglang.srt.arg_groups.overrides import declare_resolution, model_config_of, resolving_view

    from .platforms.cpu import DEFAULT_MAX_TOTAL_TOKENS

    cfg = resolving_view(server_args)
    hf = model_config_of(server_args).hf_config
    is_dsv4 = (getattr(hf, "architectures", None) or [None])[0] in DSV4_ARCHS
    if is_dsv4 and cfg.speculative_algorithm:
        raise ValueError(
            f"--speculative-algorithm {cfg.speculative_algorithm}: speculative decoding for DeepSeek-V4 is not "
            "available in sglang-dsv4-ascend yet (NextN and DSpark workers are planned); serve without it"
        )
    previous(server_args)
    if not is_dsv4 or cfg.device != "cpu":
        return
    decl = {}
    if cfg.context_length is None:
        cap = cfg.max_total_tokens or DEFAULT_MAX_TOTAL_TOKENS
        decl["context_length"] = int(min(getattr(hf, "max_position_embeddings", cap), cap))
    if cfg.max_running_requests in (None, 256):  # 256: SGLang's DSV4 default, not a user choice
        decl["max_running_requests"] = CPU_DSV4_MAX_RUNNING_REQUESTS
    if decl:
        logger.info("dsv4_ascend on CPU: %s (pass the flags to change)", decl)
        declare_resolution(server_args, "sglang_dsv4_ascend", **decl)


def _install_model_override():
    import sglang.srt.arg_groups.overrides  # noqa: F401  (in-tree providers first: last one wins)
    from sglang.srt.arg_groups.model_override_base import register_model_override
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    for arch in DSV4_ARCHS:
        register_model_override(arch)(_dsv4_overrides)
    register_resolution_hook("handle_model_specific_adjustments")(_model_adjustments)


def _build_token_to_kv_pool(orig, self, *, sizes, is_dsa_model, is_dsv4_model, req_to_token_pool):
    """Build our DSV4 pool where SGLang would build (and, for an OOT platform, reject) its own.
    Its compressed entries are paged through `req_to_token`, one entry row per r token slots."""
    if not is_dsv4_model:
        return orig(self, sizes=sizes, is_dsa_model=is_dsa_model, is_dsv4_model=is_dsv4_model,
                    req_to_token_pool=req_to_token_pool)
    from sglang.srt.runtime_context import get_schedule

    from .attention_backend.pool import DSV4TokenToKVPool
    from .config import DSV4Config

    cfg = DSV4Config.from_hf(self.model_config.hf_config)
    dtype = self.model_config.dtype
    if self.kv_cache_dtype != dtype:
        logger.info("dsv4_ascend: caches are kept in the model dtype %s (kv_cache_dtype %s is not "
                    "supported yet)", dtype, self.kv_cache_dtype)
    return DSV4TokenToKVPool(
        size=sizes.max_total_num_tokens, page_size=get_schedule().page_size, dtype=dtype, cfg=cfg,
        req_to_token=req_to_token_pool.req_to_token, spec_slack=0, device=self.device,
    )


def _install_kv_pool_hook():
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(HOOK_KV_POOL_TARGET.replace(":", "."), _build_token_to_kv_pool, HookType.AROUND)


HOOK_KV_POOL_TARGET = "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._build_token_to_kv_pool"

def _install_quantization():
    """`w8a8_ascend` in SGLang's quantization table (a plain dict: no register function exists,
    so every process inserts it) and in the --quantization choices."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    from .quantization.w8a8_ascend import NAME, W8A8AscendConfig

    QUANTIZATION_METHODS[NAME] = W8A8AscendConfig
    if NAME not in choices.QUANTIZATION_CHOICES:
        choices.add_quantization_method_choices([NAME])


# (name, installer) pairs for the components that exist.
COMPONENTS: list = [
    ("model:DeepseekV4ForCausalLM", _install_models),
    (f"attention_backend:{BACKEND_NAME}", _install_attention_backend),
    ("model_override:DeepseekV4ForCausalLM", _install_model_override),
    ("quantization:w8a8_ascend", _install_quantization),
]

HOOKS: list = [
    Hook("dsv4_kv_pool", HOOK_KV_POOL_TARGET,
         ("self", "sizes", "is_dsa_model", "is_dsv4_model", "req_to_token_pool"), _install_kv_pool_hook),
]
