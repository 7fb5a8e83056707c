"""CPU reference platform: stock SGLang serving on a machine with no accelerator.

Stock SGLang 0.5.23 does not serve on CPU as shipped (`--device cpu` dies importing vllm's rotary
kernels, and `SGLANG_USE_CPU_ENGINE=1` needs a CPU build of sgl-kernel that PyPI lacks). As an
out-of-tree (OOT) platform we get SGLang's torch-native fallbacks everywhere and supply the
defaults that make it work, so a CPU user runs the same `sglang serve` command as on an NPU.

This is the reference every test in this repository runs on. The Ascend platform will keep this
class structure (defaults, pools, workers) as a subclass of SGLang's NPU platform.
"""

from __future__ import annotations

import logging
import os

from sglang.srt.platforms.cpu import CpuDeviceMixin
from sglang.srt.platforms.device_mixin import PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from .. import settings
from ..names import CPU_MAX_TOTAL_TOKENS, SPEC_ALGOS
from .threads import BIND_ENV, rank_core_bind, scheduler_threads

logger = logging.getLogger(__name__)


# An idle scheduler polls its sockets in a busy loop: one full core per server with no requests
# (measured 1.01 cores on the 2-core CI machine; 0.01-0.02 with --sleep-on-idle, same throughput).
class CpuReferencePlatform(CpuDeviceMixin, SRTPlatform):
    """CpuDeviceMixin supplies memory from psutil and the gloo backend; SRTPlatform's defaults
    already give a CPU group coordinator, the "native" dispatch key and no speculative workers."""

    _enum = PlatformEnum.OOT
    device_name = "cpu"
    device_type = "cpu"
    # No Triton launches on CPU: SGLang then uses its torch-native allocator and writers. Graph
    # capture: SGLang's CPU graph runner under --enable-torch-compile (get_graph_runner_cls).
    capabilities = PlatformCapabilities(graph_capture=True)

    def get_device(self, device_id: int = 0):
        # SGLang formats and compares this as a string in several places.
        return "cpu"

    def is_pin_memory_available(self, device=None) -> bool:
        return False

    def apply_server_args_defaults(self, server_args) -> None:
        # Only fields the user left unset; writes here become declarations that model
        # overrides (e.g. DeepSeek-V4's) may still replace.
        if getattr(server_args, "device", None) in (None, "auto"):
            server_args.device = "cpu"
        if getattr(server_args, "attention_backend", None) is None:
            server_args.attention_backend = "torch_native"
        if getattr(server_args, "sampling_backend", None) is None:
            server_args.sampling_backend = "pytorch"
        if not getattr(server_args, "sleep_on_idle", False) and settings.CPU_SLEEP_ON_IDLE.get():
            server_args.sleep_on_idle = True
            logger.info(
                "CPU reference platform: --sleep-on-idle on (an idle scheduler would otherwise spin a "
                "core; %s=0 to keep SGLang's polling)",
                settings.CPU_SLEEP_ON_IDLE.name,
            )
        ranks = (getattr(server_args, "tp_size", 1) or 1) * (getattr(server_args, "pp_size", 1) or 1)
        if not getattr(server_args, "enable_dp_attention", False):  # plain --dp-size: that many replicas
            ranks *= getattr(server_args, "dp_size", 1) or 1
        if ranks > 1 and not os.environ.get(BIND_ENV):
            # SGLang's CPU path wants one NUMA node per rank unless told which cores each rank
            # binds (its assert names this variable); the children inherit it.
            os.environ[BIND_ENV] = rank_core_bind(ranks)
            logger.info(
                "CPU reference platform: %d ranks bound to cores %s (%s to change)",
                ranks,
                os.environ[BIND_ENV],
                BIND_ENV,
            )
        if getattr(server_args, "max_total_tokens", None) is None:
            server_args.max_total_tokens = CPU_MAX_TOTAL_TOKENS
            logger.info(
                "CPU reference platform: capping the KV pool at %d tokens (--max-total-tokens to change)",
                CPU_MAX_TOTAL_TOKENS,
            )

    def post_load_model(self, model) -> None:
        """In each scheduler process, after the model is loaded: its intra-op thread count."""
        import torch

        ranks = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        # plain --dp-size replicas are separate worlds of their own; the bind list counts them all
        ranks = max(ranks, len([p for p in os.environ.get(BIND_ENV, "").split("|") if p]))
        n = scheduler_threads(ranks=ranks)
        torch.set_num_threads(n)
        logger.info(
            "CPU reference platform: %d intra-op thread(s) per scheduler (%s to change)", n, settings.CPU_THREADS.name
        )

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def get_default_speculative_draft_attention_backend(self, algorithm: str) -> str:
        return "torch_native"

    def supports_speculative_algorithm(self, algorithm: str) -> bool:
        # EAGLE/NEXTN: our DeepSeek-V4 worker (other models get SGLang's, which may not run here).
        return str(algorithm).upper() in SPEC_ALGOS

    def get_speculative_worker_cls(self, algorithm: str):
        """Our DeepSeek-V4 NextN worker for EAGLE (NEXTN is SGLang's alias); None keeps SGLang's
        own worker for everything else (its startup checks then refuse what it cannot serve)."""
        from sglang_dsv4_ascend.speculative.worker import worker_cls_for

        return worker_cls_for(algorithm)

    def get_graph_runner_cls(self):
        from sglang_dsv4_ascend.integration.graph_runner import cpu_graph_runner_cls

        return cpu_graph_runner_cls()

    def get_kv_pool_cls(self, *, kind):
        if kind == "mha":
            from sglang_dsv4_ascend.platforms.cpu_pools import CpuMHATokenToKVPool

            return CpuMHATokenToKVPool
        return None
