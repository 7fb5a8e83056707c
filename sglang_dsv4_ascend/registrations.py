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
from .names import BACKEND_NAME, DSV4_ARCH, DSV4_ARCHS, MODELS_PACKAGE, QUANT_METHOD, RADIX_BACKEND

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


def _install_radix_cache():
    from sglang.srt.mem_cache.registry import register_radix_cache_backend, registered_radix_cache_backends

    from .attention_backend.radix import create_dsv4_radix_cache

    if RADIX_BACKEND not in registered_radix_cache_backends():
        register_radix_cache_backend(RADIX_BACKEND, create_dsv4_radix_cache)


def _install_model_override():
    import sglang.srt.arg_groups.overrides  # noqa: F401  (in-tree providers first: last one wins)
    from sglang.srt.arg_groups.model_override_base import register_model_override
    from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

    from .server_defaults import checkpoint_checks, dsv4_overrides, model_adjustments

    for arch in DSV4_ARCHS:
        register_model_override(arch)(dsv4_overrides)
    register_resolution_hook("handle_model_source_paths")(checkpoint_checks)
    register_resolution_hook("handle_model_specific_adjustments")(model_adjustments)


def _build_token_to_kv_pool(orig, self, *, sizes, is_dsa_model, is_dsv4_model, req_to_token_pool):
    """Build our DSV4 pool where SGLang would build (and, for an OOT platform, reject) its own.
    Its compressed entries are paged through `req_to_token`, one entry row per r token slots."""
    if not is_dsv4_model:
        return orig(self, sizes=sizes, is_dsa_model=is_dsa_model, is_dsv4_model=is_dsv4_model,
                    req_to_token_pool=req_to_token_pool)
    from sglang.srt.runtime_context import get_memory, get_schedule

    from .attention_backend.pool import DSV4TokenToKVPool
    from .config import DSV4Config

    cfg = DSV4Config.from_hf(self.model_config.hf_config)
    dtype = self.model_config.dtype
    if self.kv_cache_dtype != dtype:
        logger.info("dsv4_ascend: caches are kept in the model dtype %s (kv_cache_dtype %s is not "
                    "supported yet)", dtype, self.kv_cache_dtype)
    return DSV4TokenToKVPool(
        size=sizes.max_total_num_tokens, page_size=get_schedule().page_size, dtype=dtype, cfg=cfg,
        req_to_token=req_to_token_pool.req_to_token, spec_slack=_spec_slack(), device=self.device,
        prefix_states=not get_memory().disable_radix_cache,
    )


def _spec_slack() -> int:
    """Positions a verify reads past the committed length: the tree's depth + 1 <= draft tokens.
    Verify writes are deferred and only accepted rows are stored, so the rings need no extra rows
    for rejected ones; the slack is what lets a verify at the end of the context stay in range."""
    from sglang.srt.runtime_context import get_spec

    spec = get_spec()
    if not spec.speculative_algorithm:
        return 0
    return int(max(spec.speculative_num_draft_tokens or 0, (spec.speculative_num_steps or 0) + 1))


def _platform_worker_cls(orig, self):
    """SGLang asks an out-of-tree platform for a worker (our CPU platform answers); SGLang's own
    NPU platform is not out of tree and is never asked, so EAGLE / NEXTN on DeepSeek-V4 would get
    SGLang's EAGLE worker, which cannot drive our model. Ours is returned where SGLang has none."""
    cls = orig(self)
    if cls is not None:
        return cls
    from .speculative.worker import worker_cls_for

    return worker_cls_for(self.name)


def _handle_eagle_family(orig, server_args):
    """SGLang refuses EAGLE topk > 1 with pages > 1 unless the backend is one of its cascade
    backends, which duplicate pages per branch. Our worker verifies trees as root-to-leaf paths
    over positional slots and needs no cascade; the check is run with a backend it accepts and
    ours is declared back right after (the last declaration wins)."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from .server_defaults import declared_during

    cfg = resolving_view(server_args)
    if not (cfg.attention_backend == BACKEND_NAME and (cfg.speculative_eagle_topk or 1) > 1):
        return orig(server_args)
    with declared_during(server_args, "sglang_dsv4_ascend.tree_check", {"attention_backend": "triton"},
                         {"attention_backend": BACKEND_NAME}):
        return orig(server_args)


def _handle_dspark(orig, server_args):
    """SGLang's DSpark argument step, for its own worker's kernels, refuses every device but
    CUDA / NPU / XPU and wants --enable-dp-lm-head under DP attention. For DeepSeek-V4 on our
    backend the worker is ours (plain PyTorch, any device) and our model never reads
    --enable-dp-lm-head (its vocab-parallel head always gathers over the attention-TP group
    itself, layers/vocab_parallel.py, which is what that flag asks SGLang's head to do). So the step runs
    with the device declared "npu" on CPU (its checks that read the device only relax
    DP-attention rules made for its own MoE kernels) and, under DP attention, the flag declared
    on; both are declared back right after (the last declaration wins). Everything else it
    resolves (draft path = the bundled checkpoint, steps 1, topk 1, draft tokens = gamma + 1,
    gamma from --speculative-dspark-block-size or the checkpoint) is kept."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from .server_defaults import declared_during

    cfg = resolving_view(server_args)
    during, after = {}, {}
    if cfg.attention_backend == BACKEND_NAME:
        if cfg.device == "cpu":
            during["device"], after["device"] = "npu", "cpu"
        if (cfg.attn_dp_size or 1) > 1 and not cfg.enable_dp_lm_head:
            during["enable_dp_lm_head"], after["enable_dp_lm_head"] = True, False
    if not during:
        return orig(server_args)
    with declared_during(server_args, "sglang_dsv4_ascend.dspark_device", during, after):
        return orig(server_args)


def _hook(target: str, fn_path: str, kind: str):
    """Installer for one HookRegistry hook: `fn_path` ("module:function" in this package)
    imported only when the hook is installed."""

    def install():
        import importlib

        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        mod, name = fn_path.split(":")
        fn = getattr(importlib.import_module(mod, __package__), name)
        HookRegistry.register(target.replace(":", "."), fn, getattr(HookType, kind))

    return install


HOOK_KV_POOL_TARGET = "sglang.srt.mem_cache.kv_cache_configurator:KVCacheConfigurator._build_token_to_kv_pool"
HOOK_VALIDATE_TARGET = "sglang.srt.managers.tokenizer_manager:TokenizerManager._validate_one_request"
HOOK_HTTP_TARGET = "sglang.srt.entrypoints.http_server:launch_server"
HOOK_GENERATE_STREAM_TARGET = "sglang.srt.entrypoints.http_server:serve_generate_request"
HOOK_NORMALIZE_TARGET = "sglang.srt.managers.io_struct:GenerateReqInput.normalize_batch_and_arguments"
HOOK_EAGLE_ARGS_TARGET = "sglang.srt.arg_groups.speculative_hook:_handle_eagle_family"
HOOK_DSPARK_ARGS_TARGET = "sglang.srt.arg_groups.speculative_hook:_handle_dspark"
HOOK_CHAT_STREAM_TARGET = "sglang.srt.entrypoints.openai.serving_chat:OpenAIServingChat._generate_chat_stream"
HOOK_COMPLETION_STREAM_TARGET = ("sglang.srt.entrypoints.openai.serving_completions:"
                                 "OpenAIServingCompletion._generate_completion_stream")
HOOK_OUTPUT_METRICS_TARGET = "sglang.srt.beam_search.output:try_build_beam_search_out_dict"
HOOK_SPEC_METRICS_TARGET = "sglang.srt.managers.tokenizer_manager:TokenizerManager._calculate_spec_decoding_metrics"
HOOK_SPEC_WORKER_TARGET = "sglang.srt.speculative.spec_info:SpeculativeAlgorithm.get_platform_worker_cls"
HOOK_LAST_LOC_TARGET = "sglang.srt.mem_cache.allocation:get_last_loc"
HOOK_ASSIGN_TARGET = "sglang.srt.mem_cache.allocation:assign_req_to_token_pool_func"
HOOK_MLP_SYNC_TARGET = "sglang.srt.model_executor.forward_batch_info:ForwardBatch.prepare_mlp_sync_batch"


def _install_quantization():
    """`w8a8_ascend` in SGLang's quantization table (a plain dict: no register function exists,
    so every process inserts it) and in the --quantization choices."""
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    from .quantization.w8a8_ascend import W8A8AscendConfig

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

HOOKS: list = [
    Hook("dsv4_kv_pool", HOOK_KV_POOL_TARGET,
         ("self", "sizes", "is_dsa_model", "is_dsv4_model", "req_to_token_pool"),
         _hook(HOOK_KV_POOL_TARGET, ".registrations:_build_token_to_kv_pool", "AROUND")),
    Hook("request_validation", HOOK_VALIDATE_TARGET, ("self", "obj", "input_ids"),
         _hook(HOOK_VALIDATE_TARGET, ".request_guard:validate_one_request_hook", "BEFORE")),
    Hook("request_normalize_errors", HOOK_NORMALIZE_TARGET, ("self",),
         _hook(HOOK_NORMALIZE_TARGET, ".request_guard:normalize_hook", "AROUND")),
    Hook("eagle_tree_page_check", HOOK_EAGLE_ARGS_TARGET, ("server_args",),
         _hook(HOOK_EAGLE_ARGS_TARGET, ".registrations:_handle_eagle_family", "AROUND")),
    Hook("dspark_args_on_cpu", HOOK_DSPARK_ARGS_TARGET, ("server_args",),
         _hook(HOOK_DSPARK_ARGS_TARGET, ".registrations:_handle_dspark", "AROUND")),
    Hook("nextn_worker_on_builtin_platforms", HOOK_SPEC_WORKER_TARGET, ("self",),
         _hook(HOOK_SPEC_WORKER_TARGET, ".registrations:_platform_worker_cls", "AROUND")),
    Hook("cpu_spec_last_loc", HOOK_LAST_LOC_TARGET, ("req_to_token", "req_pool_indices_tensor", "prefix_lens_tensor"),
         _hook(HOOK_LAST_LOC_TARGET, ".platforms.cpu_alloc:get_last_loc", "AROUND")),
    Hook("cpu_spec_assign_slots", HOOK_ASSIGN_TARGET,
         ("req_pool_indices", "req_to_token", "start_offset", "end_offset", "out_cache_loc", "batch_size"),
         _hook(HOOK_ASSIGN_TARGET, ".platforms.cpu_alloc:assign_req_to_token_pool_func", "AROUND")),
    Hook("cpu_dp_attention_sync", HOOK_MLP_SYNC_TARGET, ("self", "model_runner"),
         _hook(HOOK_MLP_SYNC_TARGET, ".platforms.cpu_alloc:prepare_mlp_sync_batch", "AROUND")),
    Hook("spec_stats_every_output", HOOK_OUTPUT_METRICS_TARGET, ("recv_obj", "i", "meta_info"),
         _hook(HOOK_OUTPUT_METRICS_TARGET, ".spec_stream:every_output_metrics", "BEFORE")),
    Hook("spec_accept_length_from_rounds", HOOK_SPEC_METRICS_TARGET, ("self", "meta_info", "recv_obj", "i"),
         _hook(HOOK_SPEC_METRICS_TARGET, ".spec_stream:verify_round_metrics", "AROUND")),
    Hook("spec_stats_every_chat_chunk", HOOK_CHAT_STREAM_TARGET,
         ("self", "adapted_request", "request", "raw_request"),
         _hook(HOOK_CHAT_STREAM_TARGET, ".spec_stream:stream_with_stats", "AROUND")),
    Hook("spec_stats_every_completion_chunk", HOOK_COMPLETION_STREAM_TARGET,
         ("self", "adapted_request", "request", "raw_request"),
         _hook(HOOK_COMPLETION_STREAM_TARGET, ".spec_stream:stream_with_stats", "AROUND")),
    Hook("http_request_gate", HOOK_HTTP_TARGET,
         ("server_args", "init_tokenizer_manager_func", "run_scheduler_process_func",
          "run_detokenizer_process_func", "execute_warmup_func", "launch_callback"),
         _hook(HOOK_HTTP_TARGET, ".request_guard:add_request_gate", "BEFORE")),
    Hook("generate_stream_refusals", HOOK_GENERATE_STREAM_TARGET, ("obj", "request"),
         _hook(HOOK_GENERATE_STREAM_TARGET, ".request_guard:stream_refusals_hook", "AROUND")),
]
