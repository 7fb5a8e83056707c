"""The trained tiny DeepSeek-V4 that ships with the package (sglang_dsv4_ascend.TINY_MODEL_PATH):
it is the documented shape, HF transformers loads both variants with no missing or unexpected
keys and gives our logits on a real prompt, its drafts load under their released names, its
confidence calibration is readable, and it stays small."""

import json
import os

import pytest
import torch
from prompts import load_prompts

import sglang_dsv4_ascend as pkg
from sglang_dsv4_ascend.batch import Segment
from sglang_dsv4_ascend.models.dspark import load_dspark_from_dir, load_sts
from sglang_dsv4_ascend.models.nextn import load_nextn_from_dir
from sglang_dsv4_ascend.models.weights import load_model_from_dir
from sglang_dsv4_ascend.tools import make_tiny_checkpoint as mk
from sglang_dsv4_ascend.tools.tiny_corpus import chat_prompt

VARIANTS = {"dspark": pkg.TINY_MODEL_PATH, "nextn": pkg.TINY_NEXTN_MODEL_PATH}


@pytest.mark.parametrize("draft", list(VARIANTS))
def test_config_is_the_trained_preset(draft):
    with open(os.path.join(VARIANTS[draft], "config.json")) as f:
        assert json.load(f) == mk.build_config(mk.PRESETS["trained"], draft)


@pytest.fixture(scope="module")
def ids():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(pkg.TINY_MODEL_PATH)
    text = chat_prompt(load_prompts("humaneval", 1, max_chars=None)[0])
    out = torch.tensor(tok(text, add_special_tokens=False).input_ids)
    assert out.numel() > 128  # crosses the window (64) and a 128-token HCA block
    return out


@pytest.mark.parametrize("draft", list(VARIANTS))
def test_hf_loads_it_cleanly_and_agrees(draft, ids):
    from transformers import DeepseekV4ForCausalLM

    hf, info = DeepseekV4ForCausalLM.from_pretrained(
        VARIANTS[draft], torch_dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = load_model_from_dir(VARIANTS[draft])
    with torch.no_grad():
        want = hf.eval()(ids[None], use_cache=False).logits[0]
    cache = ours.make_cache(1, ids.numel())
    got = ours.compute_logits(ours(ids, torch.arange(ids.numel()), [Segment(0, 0, ids.numel())], cache))
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_drafts_load_and_calibration_is_shipped():
    model = load_model_from_dir(pkg.TINY_MODEL_PATH)
    load_nextn_from_dir(pkg.TINY_NEXTN_MODEL_PATH, model.cfg)
    draft = load_dspark_from_dir(pkg.TINY_MODEL_PATH, model.cfg)
    assert draft.mtp[-1].confidence_head.proj.bias is not None
    temps = load_sts(pkg.TINY_STS_PATH)
    assert len(temps) == model.cfg.dspark_block_size and all(0 < t < 10 for t in temps)


def test_it_stays_small():
    """Every retrain adds its size to the git history: keep the shipped files bounded."""
    total = 0
    for d in VARIANTS.values():
        for f in os.listdir(d):
            p = os.path.join(d, f)
            if not os.path.islink(p):
                total += os.path.getsize(p)
        # the NextN variant shares the trunk and tokenizer with the DSpark one
    assert os.path.islink(os.path.join(pkg.TINY_NEXTN_MODEL_PATH, "model-00001-of-00002.safetensors"))
    assert total < 40 * 2**20, total
