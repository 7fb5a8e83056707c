"""Loading and config errors name the tensor / field, the expected value and (when known) the file."""

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from sglang_dsv4_ascend.config import DSV4Config
from sglang_dsv4_ascend.models.trunk import DSV4Model
from sglang_dsv4_ascend.models.weights import iter_checkpoint, load_model_from_dir, load_released_weights


@pytest.fixture(scope="module")
def flash(tiny_ckpt):
    path = tiny_ckpt("flash")
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    return path, raw, list(iter_checkpoint(path))


def _load(raw, weights):
    load_released_weights(DSV4Model(DSV4Config.from_hf(raw)), weights, source="ckpt-dir")


def _replace(weights, name, tensor):
    return [(n, tensor if n == name else t, f) for n, t, f in weights]


def test_complete_checkpoint_loads_and_skips_draft_tensors(flash):
    path, raw, weights = flash
    assert not any(n.startswith("mtp.") for n, _, _ in weights)
    _load(raw, weights + [("mtp.0.e_proj.weight", torch.zeros(3), "x")])  # draft names are ignored


def test_dropped_tensor(flash):
    _, raw, weights = flash
    kept = [w for w in weights if w[0] != "layers.2.attn.indexer.compressor.ape"]
    with pytest.raises(
        ValueError, match=r"missing .*'layers\.2\.attn\.indexer\.compressor\.ape' expected shape \(4, 64\)"
    ):
        _load(raw, kept)


def test_wrong_shape_names_tensor_expected_shape_and_file(flash):
    _, raw, weights = flash
    bad = _replace(weights, "layers.3.attn.compressor.wkv.weight", torch.zeros(128, 64))
    msg = (
        r"'layers\.3\.attn\.compressor\.wkv\.weight' \(file model-00001-of-00002\.safetensors\) "
        r"has shape \(128, 64\), expected \(64, 64\)"
    )
    with pytest.raises(ValueError, match=msg):
        _load(raw, bad)


def test_unexpected_tensor(flash):
    _, raw, weights = flash
    extra = weights + [("layers.0.attn.indexer.wq_b.weight", torch.zeros(2, 2), "extra.safetensors")]
    with pytest.raises(
        ValueError, match=r"unexpected tensor 'layers\.0\.attn\.indexer\.wq_b\.weight' \(file extra\.safetensors\)"
    ):
        _load(raw, extra)  # layer 0 of flash is SWA-only: no indexer


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int64, torch.bool])
def test_non_checkpoint_dtype_is_named_as_such(flash, dtype):
    """Not "quantized": a float64 / int32 weight is simply not a checkpoint dtype."""
    _, raw, weights = flash
    bad = _replace(weights, "layers.0.attn.wq_a.weight", torch.zeros(32, 64, dtype=dtype))
    with pytest.raises(
        ValueError, match=re.escape(f"dtype {dtype} is not a checkpoint dtype; expected bf16 / fp16 / fp32")
    ):
        _load(raw, bad)


@pytest.mark.parametrize(
    "name,tensor",
    [
        ("layers.0.attn.wq_a.weight", torch.zeros(32, 64).to(torch.float8_e4m3fn)),
        ("layers.0.attn.wq_a.scale", torch.ones(1, 1)),
        ("layers.3.ffn.experts.0.w1.weight", torch.zeros(32, 32, dtype=torch.int8)),  # packed FP4
    ],
)
def test_quantized_weights_are_refused_clearly(flash, name, tensor):
    _, raw, weights = flash
    bad = (
        _replace(weights, name, tensor)
        if any(n == name for n, _, _ in weights)
        else weights + [(name, tensor, "q.safetensors")]
    )
    with pytest.raises(ValueError, match=re.escape(repr(name)) + r".*FP8/FP4 released weights are not supported yet"):
        _load(raw, bad)


def test_tid2eid_out_of_range(flash):
    _, raw, weights = flash
    bad = _replace(weights, "layers.1.ffn.gate.tid2eid", torch.full((1024, 2), 8, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"'layers\.1\.ffn\.gate\.tid2eid'.*expected integer expert ids in \[0, 8\)"):
        _load(raw, bad)


def test_load_model_from_dir_names_the_file(flash, tmp_path):
    path, _, _ = flash
    for f in os.listdir(path):
        os.symlink(os.path.join(path, f), tmp_path / f)
    shard = "model-00001-of-00002.safetensors"
    tensors = load_file(os.path.join(path, shard))
    tensors["norm.weight"] = torch.zeros(65)
    (tmp_path / shard).unlink()
    save_file(tensors, str(tmp_path / shard))
    with pytest.raises(
        ValueError,
        match=r"'norm\.weight' \(file model-00001-of-00002\.safetensors\) has shape \(65,\), expected \(64,\)",
    ):
        load_model_from_dir(str(tmp_path))


@pytest.mark.parametrize(
    "field,value,pattern",
    [
        ("compress_ratios", [0, 0, 8, 128, 4, 0], r"compress_ratios\[2\]=8 is invalid; expected one of \(0, 4, 128\)"),
        ("compress_ratios", [0, 0, 4, 128, 4, 4], r"compress_ratios\[5\] \(draft layer\)=4 is invalid; expected 0"),
        # one message naming the field, the expected length and what each entry may be
        (
            "compress_ratios",
            [0, 0, 4, 128, 4, 0, 0, 0],
            r"compress_ratios=\[.*\] is invalid; expected a list of 6 integers "
            r"\(num_hidden_layers=5 main-layer entries, "
            r"each one of \(0, 4, 128\), then num_nextn_predict_layers=1 draft entries, each 0\)",
        ),
        ("compress_ratios", "0,0,4", r"compress_ratios='0,0,4' is invalid; expected a list of 6 integers"),
        ("sliding_window", 0, r"sliding_window=0 is invalid; expected a positive integer"),  # 0 is a value, not "unset"
        ("swiglu_limit", -1.0, r"swiglu_limit=-1\.0 is invalid; expected a number >= 0 \(0 disables the clamp\)"),
        ("swiglu_limit", 0.0, None),  # documented: 0 = no clamp
        (
            "rope_scaling",
            {"type": "yarn", "factor": 0, "original_max_position_embeddings": 64},
            r"rope_parameters\.compress\.factor=0\.0 is invalid",
        ),
        (
            "rope_scaling",
            {"type": "yarn", "factor": 4, "original_max_position_embeddings": 64, "beta_fast": 0},
            r"beta_fast/beta_slow=\(0\.0, 1\.0\) is invalid",
        ),
        ("index_topk", 0, r"index_topk=0 is invalid; expected a positive integer"),
        ("o_groups", 3, r"o_groups=3 is invalid; expected a divisor of num_attention_heads=4"),
        ("hc_mult", 0, r"hc_mult=0 is invalid; expected an integer >= 1"),
        ("num_experts_per_tok", 9, r"num_experts_per_tok=9 is invalid; expected 1 <= k <= n_routed_experts=8"),
        ("num_hash_layers", 6, r"num_hash_layers=6 is invalid; expected 0 <= num_hash_layers <= num_hidden_layers=5"),
        ("compress_ratios", [0, 0, 4], r"compress_ratios=\[0, 0, 4\] is invalid; expected a list of 6 integers"),
        ("scoring_func", "softmax", r"scoring_func='softmax' is invalid; expected 'sqrtsoftplus'"),
        ("qk_rope_head_dim", 15, r"qk_rope_head_dim=15 is invalid; expected an even number"),
        ("index_topk", 2, None),  # control: a valid change passes
    ],
)
def test_bad_config_field(flash, field, value, pattern):
    _, raw, _ = flash
    cfg = dict(raw, **{field: value})
    if pattern is None:
        DSV4Config.from_hf(cfg)
        return
    with pytest.raises(ValueError, match=pattern):
        DSV4Config.from_hf(cfg)


def test_hidden_size_must_divide_without_head_dim(flash):
    _, raw, _ = flash
    cfg = {k: v for k, v in raw.items() if k != "head_dim"}
    cfg["hidden_size"] = 66
    with pytest.raises(ValueError, match=r"hidden_size=66 is invalid; expected divisible by num_attention_heads=4"):
        DSV4Config.from_hf(cfg)


def test_missing_required_field(flash):
    _, raw, _ = flash
    with pytest.raises(ValueError, match=r"required field 'q_lora_rank' is missing"):
        DSV4Config.from_hf({k: v for k, v in raw.items() if k != "q_lora_rank"})
