"""The CPU reference platform makes stock SGLang serve, in every server process.

Stock SGLang 0.5.23 cannot serve on a CPU-only machine; with the plugin installed it must, with
the same command as on an NPU. (A control that started the same command with our platform off and
saw it fail in the scheduler cost a cold start of ~100 s of CI per run; it was dropped to keep the
suite in its budget. The switch itself, SGLANG_DSV4_PLATFORM=off, is unit-tested in
test_plugin_and_doctor.py.)
"""

import pytest
import torch
from prompts import load_prompts

pytestmark = pytest.mark.e2e


def _hf_greedy(model_path, prompt_ids, n):
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    out = []
    for ids in prompt_ids:
        with torch.no_grad():
            g = m.generate(
                torch.tensor([ids]),
                max_new_tokens=n,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=1,
                min_new_tokens=n,
            )
        out.append(g[0, len(ids) :].tolist())
    return out


def test_cpu_platform_serves_like_hf(tiny_llama, servers):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama)
    prompts = load_prompts("gsm8k", 2) + load_prompts("humaneval", 1)
    prompt_ids = [tok(p).input_ids[:96] for p in prompts]
    n = 12
    expected = _hf_greedy(tiny_llama, prompt_ids, n)

    srv = servers.get(tiny_llama)
    info = srv.server_info()
    # Defaults that only our platform declares (the user passed none of them).
    assert info["device"] == "cpu"
    assert info["attention_backend"] == "torch_native"
    assert info["sampling_backend"] == "pytorch"

    for ids, want in zip(prompt_ids, expected):
        got = srv.generate(ids, n, ignore_eos=True)["output_ids"]
        assert got == want

    # Concurrent requests in one batch give the same tokens as alone.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as ex:
        outs = list(ex.map(lambda ids: srv.generate(ids, n, ignore_eos=True)["output_ids"], prompt_ids))
    assert outs == expected
