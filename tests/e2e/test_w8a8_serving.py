"""`--quantization w8a8_ascend`: a ModelSlim W8A8 checkpoint made by our quantize tool is served by
a real SGLang server and gives the same greedy tokens as the in-process W8A8 model (whose numerics
are checked against independent oracles in tests/unit/test_w8a8_*)."""

import pytest
import torch
from prompts import load_prompts

from tests.oracles.decode import plain_greedy

pytestmark = pytest.mark.e2e

N_NEW = 8


def test_w8a8_checkpoint_served_equals_in_process_model(tiny_checkpoint, w8a8_checkpoint, servers):
    from transformers import AutoTokenizer

    from sglang_dsv4_ascend.models.weights import load_model_from_dir
    from sglang_dsv4_ascend.quantization.w8a8 import load_w8a8_model_from_dir

    # written by the quantize tool's command line (--scheme dynamic), once per run
    src, dst = tiny_checkpoint("flash", "dspark"), w8a8_checkpoint("flash", "dspark")
    tok = AutoTokenizer.from_pretrained(dst)
    prompts = [tok(t).input_ids[:120] for t in load_prompts("gsm8k", 2)]

    w8a8 = plain_greedy(load_w8a8_model_from_dir(dst, dtype=torch.float32), prompts, N_NEW)
    float_ = plain_greedy(load_model_from_dir(src, dtype=torch.float32), prompts, N_NEW)
    agree = sum(a == b for x, y in zip(w8a8, float_) for a, b in zip(x, y)) / (N_NEW * len(prompts))
    print(f"W8A8 vs float greedy token agreement: {agree:.2f}")

    srv = servers.get(dst, "--quantization", "w8a8_ascend")  # shared with test_parallel_serving.py
    for ids, want in zip(prompts, w8a8):
        assert srv.generate(ids, N_NEW, ignore_eos=True)["output_ids"] == want
