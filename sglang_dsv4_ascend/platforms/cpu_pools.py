"""KV pool classes for the CPU reference platform."""

from __future__ import annotations

from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool


class CpuMHATokenToKVPool(MHATokenToKVPool):
    """The in-tree MHA pool without its Triton slot-copy warm-up.

    The warm-up launches a Triton kernel at construction, which fails with no GPU driver. The
    copy it prepares moves KV slots (speculative accept paths); we route those moves to the
    in-tree torch implementation instead.
    """

    def _init_kv_copy_and_warmup(self):
        self._kv_copy_config = None
        self.use_native_move_kv_cache = True
