"""The tiny checkpoint is in the real DeepSeek-V4 format: HF transformers, an independent reader of
that format, loads every tensor with nothing missing or unexpected, and runs a forward."""

import hashlib
import json
import os

import pytest
import torch
from safetensors import safe_open

from sglang_dsv4_ascend.tools.make_tiny_checkpoint import main as make_main
from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint


def _digest(d):
    h = {}
    for f in sorted(os.listdir(d)):
        with open(os.path.join(d, f), "rb") as fh:
            h[f] = hashlib.sha256(fh.read()).hexdigest()
    return h


def _names(d):
    names = {}
    for f in os.listdir(d):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(d, f), "pt") as sf:
                for k in sf.keys():
                    names[k] = sf.get_slice(k).get_dtype()
    return names


@pytest.mark.parametrize("preset,draft", [("flash", "dspark"), ("pro", "nextn")])
def test_hf_transformers_loads_it_completely(tmp_path, preset, draft):
    from transformers import AutoTokenizer, DeepseekV4ForCausalLM

    d = write_checkpoint(str(tmp_path / "ck"), preset, draft)
    model, info = DeepseekV4ForCausalLM.from_pretrained(d, torch_dtype=torch.float32, output_loading_info=True)
    assert info["missing_keys"] == [] or info["missing_keys"] == set()
    assert not info["unexpected_keys"] and not info["mismatched_keys"] and not info["error_msgs"]
    # The checkpoint's values, not HF's initialisation, are what the model holds.
    with safe_open(os.path.join(d, "model-00001-of-00002.safetensors"), "pt") as sf:
        emb = sf.get_tensor("embed.weight").float()
        tid2eid = sf.get_tensor("layers.0.ffn.gate.tid2eid")
    assert torch.equal(model.model.embed_tokens.weight, emb)
    assert torch.equal(model.model.layers[0].mlp.gate.tid2eid, tid2eid)

    tok = AutoTokenizer.from_pretrained(d)
    ids = tok("Janet's ducks lay 16 eggs per day.", return_tensors="pt").input_ids
    assert ids[0, 0].item() == 0  # bos
    out = model(ids).logits
    assert out.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(out).all()


def test_layer_pattern_covers_every_mechanism(tmp_path):
    d = write_checkpoint(str(tmp_path / "ck"), "flash", "dspark")
    cfg = json.load(open(os.path.join(d, "config.json")))
    n = cfg["num_hidden_layers"]
    ratios = cfg["compress_ratios"]
    assert len(ratios) == n + cfg["num_nextn_predict_layers"] == n + 3
    assert {0, 4, 128} <= set(ratios[:n]) and n >= 4
    assert cfg["num_hash_layers"] >= 2 and cfg["n_routed_experts"] >= 8
    assert cfg["n_routed_experts"] > cfg["num_experts_per_tok"]
    names = _names(d)
    assert names["hc_head_fn"] == "F32" and names["layers.0.attn.attn_sink"] == "F32"
    assert names["layers.0.ffn.gate.tid2eid"] == "I64" and names["layers.0.attn.wq_a.weight"] == "BF16"
    csa = ratios.index(4)
    assert f"layers.{csa}.attn.indexer.compressor.ape" in names
    assert f"layers.{ratios.index(128)}.attn.compressor.wkv.weight" in names
    assert f"layers.{n - 1}.ffn.gate.bias" in names and f"layers.{n - 1}.ffn.gate.tid2eid" not in names
    for s in range(3):
        assert f"mtp.{s}.attn.wkv.weight" in names
    for k in (
        "mtp.0.main_proj.weight",
        "mtp.2.markov_head.markov_w1.weight",
        "mtp.2.markov_head.markov_w2.weight",
        "mtp.2.confidence_head.proj.weight",
    ):
        assert k in names


def test_fixed_seed_is_byte_identical_and_seed_matters(tmp_path):
    a = _digest(write_checkpoint(str(tmp_path / "a"), "flash", "dspark", seed=0))
    make_main([str(tmp_path / "b"), "--preset", "flash", "--seed", "0"])
    b = _digest(str(tmp_path / "b"))
    c = _digest(write_checkpoint(str(tmp_path / "c"), "flash", "dspark", seed=1))
    assert a == b
    assert a["model-00001-of-00002.safetensors"] != c["model-00001-of-00002.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]


def test_bad_arguments_are_named(tmp_path):
    with pytest.raises(ValueError, match="--preset"):
        write_checkpoint(str(tmp_path / "x"), "huge")
    with pytest.raises(ValueError, match="--draft"):
        write_checkpoint(str(tmp_path / "x"), "flash", "eagle")
