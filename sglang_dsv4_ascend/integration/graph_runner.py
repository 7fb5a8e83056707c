"""The decode graph runner of the CPU reference platform: SGLang's own `CPUGraphRunner`
(torch.compile per captured batch size under `--enable-torch-compile`), handed to SGLang through
the platform seam `get_graph_runner_cls` (an out-of-tree platform must name one for capture to
run). It changes three things: which steps replay (none with a request past the captured
context, SGLANG_DSV4_GRAPH_CONTEXT: kvcache/plan.py), the compiler, from
SGLANG_DSV4_COMPILE_BACKEND (inductor by default, as SGLang compiles; dynamo's trace alone to
debug a capture or to test one quickly), and inductor's settings (device.configure_inductor:
freezing off, bf16 rounded as eager rounds it); and it logs each batch size's capture time, the
memory it added and inductor's cache hits.

What makes DeepSeek-V4 capturable is in the backend and the model, not here: one persistent
plan per batch size refreshed before every replay (attention_backend/backend.py,
kvcache/plan.py PlanBuffers), and a forward that reads only that plan's tensors."""

from __future__ import annotations

import logging

import torch

from .. import settings
from ..device import capture_meter, configure_inductor

logger = logging.getLogger("sglang_dsv4_ascend")
_CLS = None


def cpu_graph_runner_cls():
    global _CLS
    if _CLS is None:
        from sglang.srt.model_executor.cpu_graph_runner import CPUGraphRunner

        _check_overridden(CPUGraphRunner)

        class DSV4CPUGraphRunner(CPUGraphRunner):
            def capture_one_batch_size(self, bs, forward, skip_cross_attention=False):
                configure_inductor()  # after SGLang's settings: freezing off, eager's bf16 rounding (device.py)
                compiler = settings.COMPILE_BACKEND.get()
                if self.enable_torch_compile and compiler != "inductor":
                    forward = torch.compile(
                        torch.no_grad()(self.model_runner.model.forward), dynamic=False, backend=compiler
                    )
                spent = capture_meter()
                out = super().capture_one_batch_size(bs, forward, skip_cross_attention)
                msg = "dsv4_ascend: decode batch size %d captured (torch.compile, %s) in %s"
                logger.info(msg, bs, compiler, spent())
                return out

            def can_run_graph(self, forward_batch):
                # a request past the captured context decodes eager (attention_backend graph_holds)
                holds = getattr(self.model_runner.attn_backend, "graph_holds", None)
                return super().can_run_graph(forward_batch) and (holds is None or holds(forward_batch))

        _CLS = DSV4CPUGraphRunner
    return _CLS


# The methods the subclass overrides, as SGLang 0.5.23 declares them: an override of a renamed
# method would never run (a request past the captured context would then replay a plan too
# narrow for it), so a change is refused at startup.
OVERRIDDEN = {
    "capture_one_batch_size": ("self", "bs", "forward", "skip_cross_attention"),
    "can_run_graph": ("self", "forward_batch"),
}


def _check_overridden(base) -> None:
    from .compat import check_parameters

    for name, want in OVERRIDDEN.items():
        check_parameters(f"{base.__name__}.{name} (overridden by sglang-dsv4-ascend)", getattr(base, name, None), want)
