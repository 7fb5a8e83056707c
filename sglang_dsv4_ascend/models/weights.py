"""Load released DeepSeek-V4 tensors into `DSV4Model`, with errors that name the tensor.

`DSV4Model`'s parameter names are the released names (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.gate.tid2eid`, ...), so the mapping is the identity minus what this trunk does not own:
`mtp.*` (draft layers, loaded elsewhere). Only bf16/fp16/fp32 checkpoints are accepted: the preview
release ships FP8 block-quantized linears and FP4 packed experts with `.scale` tensors, which are
refused with a clear message instead of being loaded as garbage.
"""

from __future__ import annotations

import json
import os
from typing import Iterable

import torch

from ..checkpoint import shard_files
from ..config import DSV4Config
from ..distributed.sharding import SKIP, shard
from .trunk import DSV4Model

_FLOAT_OK = (torch.float32, torch.bfloat16, torch.float16)
_QUANT_SUFFIXES = (".scale", "scale_inv", ".weight_scale", ".input_scale")


def _where(name: str, file) -> str:
    return f" (file {file})" if file else ""


_QUANT_DTYPES = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu")
    if hasattr(torch, n)
)
_PACKED_DTYPES = (torch.int8, torch.uint8)  # FP4 experts ship packed two per byte


def _dtype_error(name: str, dtype, file) -> ValueError:
    if dtype in _QUANT_DTYPES or dtype in _PACKED_DTYPES:
        return ValueError(
            f"tensor {name!r}{_where(name, file)} is quantized (dtype {dtype}): FP8/FP4 released weights are not "
            "supported yet; this loader takes bf16/fp16/fp32 checkpoints (dequantize the checkpoint first) or a "
            "ModelSlim W8A8 checkpoint with --quantization w8a8_ascend"
        )
    return ValueError(
        f"tensor {name!r}{_where(name, file)}: dtype {dtype} is not a checkpoint dtype; expected bf16 / fp16 / fp32 "
        "(or a ModelSlim W8A8 checkpoint with --quantization w8a8_ascend)"
    )


def is_ignored(name: str) -> bool:
    """Tensors this trunk does not own: draft (MTP / DSpark) layers."""
    return name.startswith("mtp.")


def load_released_weights(
    model: DSV4Model, weights: Iterable, source=None, prefix: str = "", presliced: bool = False
) -> None:
    """Copy released tensors into `model`.

    weights: (name, tensor) or (name, tensor, file) items. source: a file/dir name for all tensors,
    or a {name: file} dict, used in error messages. `prefix`: load only the tensors under it (a
    draft module: "mtp.0."), named without it in `model`; by default the trunk, without `mtp.*`.
    A sharded model (`model.layout`, distributed/) takes its slice of each split tensor and skips
    the experts another rank holds (`presliced`: the items are already this rank's parts, as
    `iter_checkpoint(part=distributed.sharding.rank_part(...))` reads them).
    Raises ValueError on a missing, unexpected, mis-shaped or quantized tensor, or an out-of-range
    tid2eid table."""
    targets = {prefix + k: v for k, v in model.state_dict(keep_vars=True).items()}
    layout = getattr(model, "layout", None)
    cfg = getattr(model, "cfg", None)
    loaded = set()

    def file_of(name, explicit=None):
        if explicit is not None:
            return explicit
        return source.get(name) if isinstance(source, dict) else source

    for item in weights:
        name, tensor = item[0], item[1]
        file = file_of(name, item[2] if len(item) > 2 else None)
        if is_ignored(name) if not prefix else not name.startswith(prefix):
            continue
        if cfg is not None and not prefix and cfg.is_dropped_tensor(name):  # IndexCache: a reusing layer's indexer
            continue
        if name.endswith(_QUANT_SUFFIXES):
            raise ValueError(
                f"tensor {name!r}{_where(name, file)} is a quantization scale: FP8/FP4 released weights "
                "are not supported yet; use a bf16/fp16/fp32 checkpoint or a ModelSlim W8A8 checkpoint "
                "with --quantization w8a8_ascend"
            )
        if tensor.is_floating_point() and tensor.dtype not in _FLOAT_OK:
            raise _dtype_error(name, tensor.dtype, file)
        if layout is not None and layout.sharded and not presliced:  # this rank's slice, or another rank's
            shape = tuple(tensor.shape)
            try:
                tensor = shard(name, tensor, layout, model.cfg.n_routed_experts, model.cfg.o_groups)
            except ValueError as e:
                raise ValueError(
                    f"tensor {name!r}{_where(name, file)} with shape {shape}: cannot split it for "
                    f"{layout.describe()}: {e}"
                ) from None
            if tensor is SKIP:
                continue
        target = targets.get(name)
        if target is None:
            raise ValueError(
                f"unexpected tensor {name!r}{_where(name, file)} with shape {tuple(tensor.shape)}: "
                f"{type(model).__name__} has no such parameter (config: {model.cfg.num_hidden_layers} layers, "
                f"ratios {list(model.cfg.compress_ratios)})"
            )
        if target.is_floating_point() and not tensor.is_floating_point():
            raise _dtype_error(name, tensor.dtype, file)
        if tuple(tensor.shape) != tuple(target.shape):
            raise ValueError(
                f"tensor {name!r}{_where(name, file)} has shape {tuple(tensor.shape)}, expected "
                f"{tuple(target.shape)} from the config"
            )
        if name.endswith("tid2eid"):
            _check_tid2eid(name, tensor, model.cfg.n_routed_experts, file)
        with torch.no_grad():
            target.copy_(tensor.to(device=target.device, dtype=target.dtype))
        loaded.add(name)

    missing = [n for n in targets if n not in loaded]
    if missing:
        shown = ", ".join(f"{n!r} expected shape {tuple(targets[n].shape)}" for n in missing[:8])
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        where = f" in {source}" if isinstance(source, str) else ""
        raise ValueError(f"missing tensor(s){where}: {shown}{more}")


def _check_tid2eid(name, t, n_experts, file):
    if t.is_floating_point() or (t.numel() and (int(t.min()) < 0 or int(t.max()) >= n_experts)):
        raise ValueError(
            f"tensor {name!r}{_where(name, file)}: expected integer expert ids in [0, {n_experts}), "
            f"got dtype {t.dtype} range [{t.min().item()}, {t.max().item()}]"
        )


def iter_checkpoint(path: str, skip=is_ignored, part=None):
    """(name, tensor, file) for every tensor of a checkpoint dir; `skip`ped names are not read.
    `part(name, safetensors slice)`: what to read of each tensor (a tensor, or SKIP to read
    nothing; `distributed.sharding.rank_part`); whole tensors by default."""
    from safetensors import safe_open

    for fname in shard_files(path)[0]:
        with safe_open(os.path.join(path, fname), framework="pt") as f:
            for name in f.keys():
                if skip is not None and skip(name):
                    continue
                t = f.get_tensor(name) if part is None else part(name, f.get_slice(name))
                if t is not SKIP:
                    yield name, t, fname


def load_model_from_dir(path: str, dtype: torch.dtype = torch.float32, device=None, layout=None) -> DSV4Model:
    """config.json + safetensors -> an eval-mode DSV4Model (this rank's part under `layout`)."""
    with open(os.path.join(path, "config.json")) as f:
        cfg = DSV4Config.from_hf(json.load(f))
    model = DSV4Model(cfg, dtype=dtype, device=device, layout=layout)
    load_released_weights(model, iter_checkpoint(path), source=path)
    return model.eval()
