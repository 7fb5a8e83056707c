"""Count the operations inside a model's layers that would make the host wait for the device.

On an accelerator a host sync is any op whose result the host must read before it can go on: a
scalar read (`.item()`, `int(t)`, `bool(t)`, `.tolist()` all reach `aten::_local_scalar_dense`), or
an op whose output *shape* depends on the data (`nonzero`, `unique`, `masked_select`, boolean-mask
indexing, `repeat_interleave` without an output size). On the CPU none of these costs anything, so
they are counted here through a TorchDispatchMode, which sees every aten op of the layers whatever
device they run on (plus `.tolist()`, `.numpy()` and `.cpu()`, which bypass it for CPU tensors):
zero here means zero syncs on an NPU or a GPU, and no obstacle to graph capture.

Only the layers are watched (forward pre/post hooks enter and leave the mode): the model's entry
checks the batch on the host on purpose, from CPU tensors it was given.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten overload packets whose result the host must read (value or shape).
_SYNC_OPS = {
    "_local_scalar_dense",
    "item",
    "is_nonzero",
    "equal",
    "nonzero",
    "nonzero_static",
    "argwhere",
    "unique",
    "_unique",
    "_unique2",
    "unique_consecutive",
    "unique_dim",
    "masked_select",
    "repeat_interleave",
    "bincount",
    "histc",
}


class _SyncCounter(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts
        self.depth = 0

    def __enter__(self):
        self.depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS and not (name == "repeat_interleave" and (kwargs or {}).get("output_size")):
            self.counts[name] += 1
        elif name == "index" and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool
            for i in (args[1] if len(args) > 1 else ())
            if i is not None
        ):
            self.counts["index(bool mask)"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_host_syncs(layers):
    """`with count_host_syncs(model.layers) as counts: model(...)` -> Counter of sync ops by name."""
    counts: Counter = Counter()
    mode = _SyncCounter(counts)
    handles = []

    def enter(*_):  # hooks must return None (a pre-hook's value would replace the layer's inputs)
        mode.__enter__()

    def leave(*_):
        mode.__exit__(None, None, None)

    for layer in layers:
        handles.append(layer.register_forward_pre_hook(enter))
        handles.append(layer.register_forward_hook(leave))
    # Tensor -> host conversions that skip the dispatcher for CPU tensors (on a device they copy).
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}

    def counted(name):
        def wrapper(self, *a, **k):
            if mode.depth:
                counts[name] += 1
            return originals[name](self, *a, **k)

        return wrapper

    for name in originals:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        for h in handles:
            h.remove()
