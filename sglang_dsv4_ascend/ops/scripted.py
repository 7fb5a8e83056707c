"""Reference ops whose cost is per-op dispatch, not arithmetic, run as TorchScript graphs.

The mHC coefficients of every sublayer (reference §1.5) are ~130 tiny ops on [T, 4, 4] tensors: a
20-iteration Sinkhorn loop plus the mix. At decode batch sizes the arithmetic is nothing and the
Python/dispatcher overhead is everything (measured on the 2-core CI machine: ~0.8 ms per call,
10 calls per tiny-model step, 21 % of a batch-1 decode step). The same functions compiled with
`torch.jit.script` run the same ops in the same order without returning to Python between them:
bit-identical results (tests/unit/test_mhc_fused.py compares them with the Python loop), about
2x faster per call on that machine at T <= 16 and no faster at T = 256, where arithmetic
dominates. Compiled lazily on first use; if TorchScript is unavailable the reference runs.

Inside a graph capture (torch.compile) the mHC coefficients are one opaque op,
`torch.ops.dsv4_ascend.mhc_weights`, that runs the same compiled function at replay. Traced op by
op, the Sinkhorn loops were a third of a DeepSeek-V4 step's graph (3,400 of the shipped tiny
model's 9,748 traced ops), and tracing costs per op (dynamo's trace of one verify bucket: ~16 s
on an idle 2-core machine); as one op they cost one, and the captured forward computes them
exactly as the eager one does (tests/unit/test_mhc_fused.py).

Bound for the 'cpu' and 'triton' kernel families; SGLANG_DSV4_FORCE_REFERENCE=1 runs the Python
reference. Not bound on the NPU (TorchScript with torch_npu tensors is unverified there).
"""

from __future__ import annotations

import logging
import warnings

import torch

from . import reference

logger = logging.getLogger("sglang_dsv4_ascend")
_compiled: dict = {}


def _get(name: str):
    if torch.compiler.is_compiling():
        # A graph capture reads nothing here: scripting inside the trace (a process whose first
        # forward is the capture) broke the graph and left the captured forward running eager,
        # and a trace that read the cache below was guarded on it and recompiled once an eager
        # forward had filled it. It records the opaque op (scripted at its first replay), or,
        # where there is none, traces the Python ops themselves (the same ops).
        return _traced.get(name) or getattr(reference, name)
    return _runtime(name)


def _runtime(name: str):
    fn = _compiled.get(name)
    if fn is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # torch.jit.script's deprecation notice
                fn = torch.jit.script(getattr(reference, name))
        except Exception as e:  # TorchScript missing or unable to compile: the reference is the same op
            logger.warning("TorchScript unavailable for %s (%s); using the Python reference", name, e)
            fn = getattr(reference, name)
        _compiled[name] = fn
    return fn


def sinkhorn(logits, iters: int, eps: float):
    return _get("sinkhorn")(logits, iters, eps)


def mhc_weights(streams, fn, base, scale, n: int, iters: int, hc_eps: float, norm_eps: float):
    return _get("mhc_weights")(streams, fn, base, scale, n, iters, hc_eps, norm_eps)


def _register_ops() -> dict:
    """The opaque ops a capture records (name -> op); none where torch.library cannot define them."""
    try:

        @torch.library.custom_op("dsv4_ascend::mhc_weights", mutates_args=())
        def mhc_weights_op(
            streams: torch.Tensor,
            fn: torch.Tensor,
            base: torch.Tensor,
            scale: torch.Tensor,
            n: int,
            iters: int,
            hc_eps: float,
            norm_eps: float,
        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            pre, post, comb = _runtime("mhc_weights")(streams, fn, base, scale, n, iters, hc_eps, norm_eps)
            # an op's outputs may not be views: these are row slices of the padded rows' results
            return pre.contiguous(), post.contiguous(), comb.contiguous()

        @mhc_weights_op.register_fake
        def _(streams, fn, base, scale, n, iters, hc_eps, norm_eps):
            T, f32 = streams.shape[0], torch.float32
            return (
                streams.new_empty(T, n, dtype=f32),
                streams.new_empty(T, n, dtype=f32),
                streams.new_empty(T, n, n, dtype=f32),
            )

    except Exception as e:  # an older torch.library: the trace records the Python ops (the same ops)
        logger.warning("no opaque mHC op for graph captures (%s); they trace its Python loop", e)
        return {}
    return {"mhc_weights": mhc_weights_op}


_traced = _register_ops()
