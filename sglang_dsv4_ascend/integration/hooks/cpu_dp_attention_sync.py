"""Hook `cpu_dp_attention_sync` (patches/README.md #13): DP attention's per-forward padding and
count exchange on CPU batches, run as SGLang's CPU engine would run it.

Why a hook: under `--enable-dp-attention` that step pins a host tensor unless the module flag
`forward_batch_info._is_cpu` is set, and pinning needs a CUDA driver, so DP attention died on the
CPU reference platform at the first forward. The flag is module state computed at import; no
registry covers it.
"""

from __future__ import annotations

from ..compat import Hook


def prepare_mlp_sync_batch(orig, self, model_runner):
    """DP attention's per-forward padding and count exchange. SGLang pins a host tensor there
    unless its own CPU engine is on (`_is_cpu`, SGLANG_USE_CPU_ENGINE), and pinning needs CUDA: on
    a CPU batch the step runs with that module flag declared, as SGLang's CPU engine would (the
    only other use of the flag there picks the backend's CPU fill value for padded seq_lens)."""
    if self.input_ids.device.type != "cpu":
        return orig(self, model_runner)
    from sglang.srt.model_executor import forward_batch_info as fbi

    saved, fbi._is_cpu = fbi._is_cpu, True
    try:
        return orig(self, model_runner)
    finally:
        fbi._is_cpu = saved


HOOK = Hook(
    "cpu_dp_attention_sync",
    "sglang.srt.model_executor.forward_batch_info:ForwardBatch.prepare_mlp_sync_batch",
    ("self", "model_runner"),
    "AROUND",
    prepare_mlp_sync_batch,
)
