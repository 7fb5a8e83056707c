"""Hook `dspark_args_on_cpu` (patches/README.md #9): SGLang's DSpark argument step runs for
DeepSeek-V4 on our backend on any device.

Why a hook: the step refuses every device but CUDA / NPU / XPU (for SGLang's own DSpark kernels)
and under DP attention wants `--enable-dp-lm-head` (for SGLang's vocab-parallel head); our DSpark
worker is plain PyTorch and our model never reads the flag.
"""

from __future__ import annotations

from ...names import BACKEND_NAME
from ..compat import Hook
from ..server_defaults import declared_during


def handle_dspark(orig, server_args):
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


HOOK = Hook(
    "dspark_args_on_cpu",
    "sglang.srt.arg_groups.speculative_hook:_handle_dspark",
    ("server_args",),
    "AROUND",
    handle_dspark,
)
