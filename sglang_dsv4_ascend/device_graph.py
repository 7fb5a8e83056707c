"""Device graphs for the speculative worker's own forwards (speculative/graphs.py: the target
verify, NextN's draft steps, the DSpark draft block): a function captured once per input signature
as a CUDA graph (`torch.cuda.CUDAGraph`) or an ACL graph (torch_npu's `torch.npu.NPUGraph`, the
same API), then replayed. `device.capture_graph` picks it on CUDA and NPU (torch.compile on CPU).

UNVERIFIED ON HARDWARE: no CUDA or NPU device has run this module. tests/unit/test_device_graph.py
runs it, and the worker's forwards through it, against an emulated graph on CPU (`Emulated`: a
replay reads the captured input tensors, rewrites the captured output tensors in place and runs
no Python), which is what the logic below relies on; what it cannot show is the device side
(stream capture rules, the memory pool, kernels that sync with the host).

A replay runs no Python, so everything the function does besides computing tensors is taken care
of here:
* tensors it is given are copied into the ones it was captured with (skipped when the caller
  passes that very tensor: the DSpark block's input buffers);
* any other object it is given (the forward plan) must be the one it was captured with (its
  tensors refreshed in place: kvcache/plan.PlanBuffers), so its identity is part of the signature;
* items it appends to a list it is given (the deferred cache writes) are appended again at every
  replay, and entries it sets in a dict it is given (the verify's streams for the draft) are set
  again;
* what it returns and what it appends or sets is cloned at every replay: the graph's output memory
  is rewritten by its next replay, and a caller may keep an earlier result (NextN's later draft
  steps read the keys its earlier steps wrote).
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import torch


def _tensors(x, fn):
    """x with every tensor inside it (lists, tuples, dicts, dataclasses) replaced by fn(tensor)."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, (list, tuple)):
        out = [_tensors(v, fn) for v in x]
        return type(x)(out) if not hasattr(x, "_fields") else type(x)(*out)
    if isinstance(x, dict):
        return {k: _tensors(v, fn) for k, v in x.items()}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        kw = {f.name: _tensors(getattr(x, f.name), fn) for f in dataclasses.fields(x) if f.init}
        return dataclasses.replace(x, **kw)
    return x


def _clone(x):
    return _tensors(x, torch.Tensor.clone)


def flat(x) -> list:
    """Every tensor inside x, in _tensors' order."""
    found = []
    _tensors(x, lambda t: found.append(t) or t)
    return found


def _plain(v) -> bool:
    """No tensor inside (the aux's layer ids, not the streams a forward leaves there)."""
    return not flat(v)


def _key(a):
    if isinstance(a, torch.Tensor):
        return ("tensor", tuple(a.shape), a.dtype, str(a.device))
    if isinstance(a, list):
        return ("list",)
    if isinstance(a, dict):  # what it holds when called, not what the call leaves in it
        return ("dict", tuple(sorted((k, repr(v)) for k, v in a.items() if _plain(v))))
    return ("object", id(a))


def _effects(args, before):
    """(arg index, 'list' | 'dict', what the call appended or set) for each list or dict argument."""
    out = []
    for i, (a, b) in enumerate(zip(args, before)):
        if isinstance(a, list):
            if a[: len(b)] != b:
                raise ValueError("device graph: a captured function may only append to a list it is given")
            out.append((i, "list", a[len(b) :]))
        elif isinstance(a, dict):
            out.append((i, "dict", {k: v for k, v in a.items() if k not in b or b[k] is not v}))
    return out


def _snapshot(args):
    return [list(a) if isinstance(a, list) else dict(a) if isinstance(a, dict) else None for a in args]


def _restore(args, before):
    for a, b in zip(args, before):
        if isinstance(a, list):
            a[:] = b
        elif isinstance(a, dict):
            a.clear()
            a.update(b)


class Captured:
    """One signature's graph: the tensors it reads, what it returns, what it appends and sets."""

    def __init__(self, graph, inputs, out, effects):
        self.graph, self.inputs, self.out, self.effects = graph, inputs, out, effects

    def replay(self, args):
        for static, a in zip(self.inputs, args):
            if isinstance(a, torch.Tensor) and a is not static:
                static.copy_(a)
        self.graph.replay()
        for i, kind, val in self.effects:
            if kind == "list":
                args[i].extend(_clone(val))
            else:
                args[i].update(_clone(val))
        return _clone(self.out)


class DeviceGraphs:
    """`fn` as device graphs, one per input signature (shapes, dtypes, the identity of non-tensor
    arguments), captured on its first call with that signature through `api` (CUDA, NPU, or the
    CPU emulation) and replayed on every later one. All graphs share one memory pool."""

    def __init__(self, fn, api):
        self.fn, self.api = fn, api
        self.captured: dict = {}
        self.pool = None

    def __call__(self, *args):
        key = tuple(_key(a) for a in args)
        entry = self.captured.get(key)
        if entry is None:
            entry = self.captured[key] = self._capture(args)
        return entry.replay(args)

    def _capture(self, args):
        before = _snapshot(args)
        # a warm-up run first, outside the capture (the library handles and workspaces kernels
        # allocate on a first call must exist before a capture): its appends and sets undone
        self.api.warm_up(self.fn, args)
        _restore(args, before)
        graph, out, self.pool = self.api.capture(self.fn, args, self.pool)
        effects = _effects(args, before)
        # the capture's own appends and sets are taken back: the replay that follows redoes them
        _restore(args, before)
        return Captured(graph, list(args), out, effects)


def _cuda_like(module) -> SimpleNamespace:
    """The capture API of torch.cuda, or of torch.npu (torch_npu mirrors it: NPUGraph, graph,
    Stream, current_stream, stream)."""

    def warm_up(fn, args):
        side = module.Stream()
        side.wait_stream(module.current_stream())
        with module.stream(side):
            fn(*args)
        module.current_stream().wait_stream(side)

    def capture(fn, args, pool):
        graph = module.CUDAGraph() if module is torch.cuda else module.NPUGraph()
        with module.graph(graph, pool=pool):
            out = fn(*args)
        return graph, out, graph.pool()

    return SimpleNamespace(warm_up=warm_up, capture=capture)


def cuda_api() -> SimpleNamespace:
    return _cuda_like(torch.cuda)


def npu_api() -> SimpleNamespace:
    return _cuda_like(torch.npu)  # torch.npu exists once device.py's accelerator() imported torch_npu


class Emulated:
    """The CPU stand-in for a device graph, for tests: capture runs the function (a device capture
    only records it) and keeps its inputs and outputs; a replay runs it again on the captured
    inputs with fresh lists and dicts (so no Python effect reaches the caller, as none would from
    a device graph) and writes every resulting tensor into the captured one in place."""

    def __init__(self, fn, args):
        self.fn, self.args = fn, list(args)
        self.held = [{k: v for k, v in a.items() if _plain(v)} if isinstance(a, dict) else None for a in args]
        self.out, self.effects = None, None

    def replay(self):
        fresh = [[] if isinstance(a, list) else {} if isinstance(a, dict) else a for a in self.args]
        for f, held in zip(fresh, self.held):
            if held is not None:  # what the dict held when captured (part of the signature)
                f.update(held)
        written = [(self.out, self.fn(*fresh))]
        for i, kind, val in self.effects:  # fresh lists hold only what this run appended
            written.append((val, fresh[i] if kind == "list" else {k: fresh[i][k] for k in val}))
        for old, new in written:
            olds, news = flat(old), flat(new)
            if len(olds) != len(news):
                raise RuntimeError("emulated graph: a replay produced other tensors than the capture")
            for o, n in zip(olds, news):
                o.copy_(n)


def emulated_api() -> SimpleNamespace:
    def warm_up(fn, args):
        fn(*args)

    def capture(fn, args, pool):
        before = _snapshot(args)
        graph = Emulated(fn, args)
        graph.out = fn(*args)
        graph.effects = _effects(args, before)
        return graph, graph.out, pool

    return SimpleNamespace(warm_up=warm_up, capture=capture)
