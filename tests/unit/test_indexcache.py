"""IndexCache (`index_topk_freq`, config.topk_source): the first CSA layer of every group of `freq`
selects its top-k, the group's other CSA layers attend with that selection.

The oracle is HF transformers' DeepseekV4ForCausalLM with its own indexer's output handed from the
group's source layer to the others (the group rule is written out here, not taken from our code):
our batched and per-segment paths must equal it on a full prefill and on HF's cached decode. Two
broken variants must be caught by the same comparison: a group that reuses the previous group's
indices instead of computing its own, and reusing layers that recompute (freq 1 run against a
freq-N oracle). freq 1 keeps today's module tree, cache layout and logits.
"""

import dataclasses
import json
import os

import pytest
import torch

from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.config import DSV4Config
from sglang_dsv4_ascend.models.trunk import DSV4Model
from sglang_dsv4_ascend.models.weights import iter_checkpoint, load_released_weights
from tests.oracles.hf import stable_topk

ATOL = RTOL = 1e-4  # as test_model_vs_hf: fp32, observed ~5e-6
T = 300
SEED = {"flash": 12, "trained": 3}


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    """flash: 2 CSA layers (one group at freq 2); trained: the trained model's 13-layer shape with
    random weights, 6 CSA layers (groups of 2 and 4, several per forward)."""
    return lambda preset: tiny_checkpoint(preset, "nextn")


def _cfg(path, freq):
    with open(os.path.join(path, "config.json")) as f:
        return dataclasses.replace(DSV4Config.from_hf(json.load(f)), index_topk_freq=freq)


def _ours(path, freq):
    model = DSV4Model(_cfg(path, freq))
    load_released_weights(model, iter_checkpoint(path), source=path)
    return model


def _ids(preset, n=T):
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(SEED[preset]))


def _groups(layer_types, freq):
    """layer -> the layer whose selection it uses: CSA layers in order, in groups of freq."""
    csa = [i for i, t in enumerate(layer_types) if t == "compressed_sparse_attention"]
    return {layer: csa[(k // freq) * freq] for k, layer in enumerate(csa)}


@pytest.fixture(scope="module")
def hf(ckpt):
    from transformers import DeepseekV4ForCausalLM

    cache = {}

    def get(preset):
        if preset not in cache:
            cache[preset] = DeepseekV4ForCausalLM.from_pretrained(ckpt(preset), torch_dtype=torch.float32).eval()
        return cache[preset]

    return get


def _hf_reusing(mp, hf_model, freq):
    """Patch HF's indexer so that each CSA layer returns its group source's top-k of this call."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as m

    source, picks, orig = _groups(hf_model.config.layer_types, freq), {}, m.DeepseekV4Indexer.forward

    def forward(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx):
        if source[layer_idx] == layer_idx:
            picks[layer_idx] = orig(self, hidden_states, q_residual, position_ids, past_key_values, layer_idx)
        return picks[source[layer_idx]]

    mp.setattr(m.DeepseekV4Indexer, "forward", forward)
    mp.setattr(torch.Tensor, "topk", stable_topk)


def _hf_logits(hf_model, ids, freq):
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        _hf_reusing(mp, hf_model, freq)
        return hf_model(ids[None], use_cache=False).logits[0]


def _our_logits(model, ids, impl="batched"):
    model.attention_impl = impl
    cache = model.make_cache(1, ids.shape[0])
    return model.compute_logits(model(ids, torch.arange(ids.shape[0]), [Segment(0, 0, ids.shape[0])], cache))


def _max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("impl", ["batched", "segments"])
@pytest.mark.parametrize("preset,freq", [("flash", 2), ("trained", 2), ("trained", 4)])
def test_reuse_matches_hf_with_the_source_layers_topk(preset, freq, impl, ckpt, hf):
    model, ids = _ours(ckpt(preset), freq), _ids(preset)
    csa = [i for i, r in enumerate(model.cfg.compress_ratios) if r == 4]
    reusing = [i for i in csa if model.layers[i].attn.indexer is None]
    assert len(reusing) == len(csa) - -(-len(csa) // freq) > 0  # only a group's first CSA layer has one
    torch.testing.assert_close(_our_logits(model, ids, impl), _hf_logits(hf(preset), ids, freq), atol=ATOL, rtol=RTOL)


def test_reuse_matches_hf_cached_prefill_then_decode(ckpt, hf):
    """Prefill in two chunks, then decode one token at a time, against HF's DynamicCache path with
    the same reuse: each HF call (and each of ours) selects afresh on its source layers."""
    from transformers.cache_utils import DynamicCache

    model, hf_model, ids, freq = _ours(ckpt("trained"), 2), hf("trained"), _ids("trained", 270), 2
    cuts = [(0, 130), (130, 250)] + [(t, t + 1) for t in range(250, 270)]
    with torch.no_grad(), pytest.MonkeyPatch.context() as mp:
        _hf_reusing(mp, hf_model, freq)
        pkv = DynamicCache(config=hf_model.config)
        pos = [torch.arange(a, b)[None] for a, b in cuts]
        ref = [
            hf_model(ids[None, a:b], past_key_values=pkv, use_cache=True, position_ids=p).logits[0]
            for (a, b), p in zip(cuts, pos)
        ]
    cache = model.make_cache(1, 270)
    ours = [model.compute_logits(model(ids[a:b], torch.arange(a, b), [Segment(0, a, b - a)], cache)) for a, b in cuts]
    torch.testing.assert_close(torch.cat(ours), torch.cat(ref), atol=ATOL, rtol=RTOL)


def test_a_group_reusing_the_previous_groups_topk_is_caught(ckpt, hf, monkeypatch):
    """Broken: every group after the first attends with the previous group's selection."""
    freq, ids = 2, _ids("trained")
    ref = _hf_logits(hf("trained"), ids, freq)
    good = _our_logits(_ours(ckpt("trained"), freq), ids)
    assert _max_diff(good, ref) < ATOL

    def previous_group(self, layer):
        csa = [i for i, r in enumerate(self.compress_ratios) if r == 4]
        c = csa.index(layer)
        return csa[max(0, c - c % self.index_topk_freq - self.index_topk_freq)]

    monkeypatch.setattr(DSV4Config, "topk_source", previous_group)
    broken = _our_logits(_ours(ckpt("trained"), freq), ids)
    assert _max_diff(broken, ref) > 100 * ATOL


def test_reusing_layers_that_recompute_are_caught(ckpt, hf):
    """Broken: the reusing layers select for themselves (freq 1) against the freq-2 oracle."""
    ids = _ids("trained")
    ref = _hf_logits(hf("trained"), ids, 2)
    assert _max_diff(_our_logits(_ours(ckpt("trained"), 1), ids), ref) > 100 * ATOL


def test_freq_one_keeps_every_indexer_and_the_logits(ckpt):
    path, ids = ckpt("trained"), _ids("trained")
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    stated = DSV4Model(DSV4Config.from_hf({**raw, "index_topk_freq": 1}))
    default = DSV4Model(DSV4Config.from_hf(raw))
    assert default.cfg.index_topk_freq == 1
    assert list(stated.state_dict()) == list(default.state_dict())
    for m in (stated, default):
        load_released_weights(m, iter_checkpoint(path), source=path)
    assert all(b.attn.indexer is not None for b in default.layers if b.attn.ratio == 4)
    assert torch.equal(_our_logits(stated, ids), _our_logits(default, ids))
    assert stated.make_cache(1, 64).nbytes() == default.make_cache(1, 64).nbytes()


def test_reusing_layers_keep_no_indexer_keys_and_load_none(ckpt):
    """The cache holds indexer rows and entries for source layers only; the checkpoint's indexer
    tensors of reusing layers are skipped (the released checkpoint loads unchanged)."""
    path = ckpt("trained")
    model = _ours(path, 2)
    cache = model.make_cache(2, 512)
    for i, st in enumerate(cache.layers):
        has = "indexer" in st.entries
        assert has == (st.ratio == 4 and model.cfg.topk_source(i) == i), i
        assert has == ("indexer" in st.rows)
        assert has == any(k.startswith(f"layers.{i}.attn.indexer.") for k in model.state_dict())
    one, two, four = (_ours(path, f).make_cache(2, 512).nbytes() for f in (1, 2, 4))
    assert two["c4_index"] * 2 == one["c4_index"] and four["c4_index"] * 3 == one["c4_index"]  # 6 -> 3 -> 2
    assert two["c4_kv"] == one["c4_kv"] and two["total"] < one["total"]
    # prefix states (radix hits) keep the open indexer rows of source layers only
    states = model.make_cache(2, 512).enable_prefix_states(page=128, capacity=2)
    assert [("indexer" in r) for r in states.rows] == [model.cfg.computes_topk(i) for i in range(len(states.rows))]


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_an_invalid_frequency_names_the_field(value, ckpt):
    with open(os.path.join(ckpt("flash"), "config.json")) as f:
        raw = json.load(f)
    with pytest.raises(ValueError, match=r"index_topk_freq=.* is invalid; expected a positive integer"):
        DSV4Config.from_hf({**raw, "index_topk_freq": value})


def test_the_field_comes_from_an_hf_config_object(ckpt, hf):
    """SGLang's --json-model-override-args sets attributes on the HF config object it hands over."""
    config = hf("flash").config
    try:
        config.index_topk_freq = 2
        assert DSV4Config.from_hf(config).index_topk_freq == 2
    finally:
        del config.index_topk_freq
    assert DSV4Config.from_hf(config).index_topk_freq == 1
