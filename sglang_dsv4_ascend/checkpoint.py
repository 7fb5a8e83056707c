"""What a checkpoint directory holds, read in one place: its index of tensors and shards, and
whether it (or the checkpoint this server serves) is a DeepSeek-V4 one.

`model.safetensors.index.json` maps each tensor name to its shard file; a checkpoint without one
is every `*.safetensors` file of the directory. The loaders (models/weights.py, the SGLang model,
the quantize tool), the startup checks (integration/server_defaults.py) and the doctor read it
through `read_index` / `shard_files` / `tensor_names`; the two checkpoint writers
(tools/make_tiny_checkpoint.py, tools/quantize_w8a8.py) write it with `write_index`.
"""

from __future__ import annotations

import functools
import json
import os

from .names import DSV4_ARCHS

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
DESCRIPTION_FILE = "quant_model_description.json"  # a ModelSlim W8A8 checkpoint's description


def read_index(model_dir: str) -> dict | None:
    """{tensor name: shard file name} from the directory's index; None when it has no index.
    An unreadable index raises (OSError, ValueError, KeyError)."""
    path = os.path.join(model_dir, INDEX_FILE)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["weight_map"]


def shard_files(model_dir: str) -> tuple[list, bool]:
    """(sorted shard file names, whether an index named them): the index's files, else every
    `*.safetensors` of the directory (ValueError if there is none)."""
    index = read_index(model_dir)
    if index is not None:
        return sorted(set(index.values())), True
    files = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files, False


def tensor_names(model_dir: str) -> set:
    """Every tensor name of the checkpoint: the index's, else read from each shard's header."""
    index = read_index(model_dir)
    if index is not None:
        return set(index)
    from safetensors import safe_open

    names = set()
    for fname in os.listdir(model_dir):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(model_dir, fname), framework="pt") as f:
                names.update(f.keys())
    return names


def write_index(out_dir: str, weight_map: dict, total_size: int) -> None:
    with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
        json.dump({"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        f.write("\n")


def is_dsv4_architectures(architectures) -> bool:
    """Whether a config's `architectures` list names DeepSeek-V4 (its first entry, as SGLang reads it)."""
    return (architectures or [None])[0] in DSV4_ARCHS


def is_dsv4_config(raw) -> bool:
    """Whether a parsed config.json names a DeepSeek-V4 architecture."""
    return isinstance(raw, dict) and is_dsv4_architectures(raw.get("architectures"))


@functools.lru_cache(maxsize=8)
def is_dsv4_checkpoint(model_path: str) -> bool:
    """Whether `model_path`'s config.json names DeepSeek-V4 (False when unreadable or absent,
    e.g. a hub id)."""
    try:
        with open(os.path.join(model_path, CONFIG_FILE)) as f:
            return is_dsv4_config(json.load(f))
    except (OSError, ValueError):
        return False


def serves_dsv4() -> bool:
    """Whether this SGLang server's model is DeepSeek-V4 (False when unknown: no server args
    published in this process, a hub id, an unreadable config)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        path = get_server_args().model_path
    except Exception:  # nothing published in this process
        return False
    return bool(path) and is_dsv4_checkpoint(path)
