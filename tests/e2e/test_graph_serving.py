"""Decode captured through SGLang's own CPU graph runner (`--enable-torch-compile`): a real server
serves DeepSeek-V4 with captured decode steps, and its greedy output equals plain in-process
decoding token for token, alone and with requests joining and leaving: one captured size (4),
replayed exact and padded (1 to 3 requests), and a batch of 5, larger than it, run eager; captured
for contexts up to 128 tokens (SGLANG_DSV4_GRAPH_CONTEXT), so every step with the 146-token prompt
runs eager through SGLang's runner and the backend, and the others replay. Bucket changes between
captured sizes are tests/unit/test_graph_capture.py's.

The compiler is dynamo's trace alone (SGLANG_DSV4_COMPILE_BACKEND=eager): what is tested here is
the capture, the static plans and the replay through SGLang's runner; the code generator
(inductor) is held to eager in process by tests/unit/test_graph_inductor.py."""

import re
from concurrent.futures import ThreadPoolExecutor

import pytest
from prompts import load_prompts

from tests.oracles.decode import plain_greedy

pytestmark = pytest.mark.e2e

LENGTHS = (6, 9, 12, 15, 18)  # five requests at once, finishing one by one: batches 5, 4, 3, 2, 1


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("flash", "dspark")


def test_captured_decode_equals_plain_decoding(ckpt, servers):
    from transformers import AutoTokenizer

    from sglang_dsv4_ascend.models.weights import load_model_from_dir

    tok = AutoTokenizer.from_pretrained(ckpt)
    prompts = [tok(t).input_ids[:150] for t in load_prompts("gsm8k", 3) + load_prompts("mt-bench", 2)]
    want = plain_greedy(load_model_from_dir(ckpt), prompts, max(LENGTHS))
    srv = servers.get(
        ckpt,
        "--enable-torch-compile",
        "--cuda-graph-bs-decode",
        "4",
        env={"SGLANG_DSV4_COMPILE_BACKEND": "eager", "SGLANG_DSV4_GRAPH_CONTEXT": "128"},
    )
    assert max(map(len, prompts)) > 128 > min(map(len, prompts)) + max(LENGTHS)
    assert srv.generate(prompts[0], 12, ignore_eos=True)["output_ids"] == want[0][:12]
    with ThreadPoolExecutor(len(prompts)) as ex:
        got = list(ex.map(lambda a: srv.generate(a[0], a[1], ignore_eos=True)["output_ids"], zip(prompts, LENGTHS)))
    assert got == [w[:n] for w, n in zip(want, LENGTHS)]
    # A request SGLang's logits processor handles differently inside the captured step (log
    # probabilities: a second trace of the captured size, not an error): same tokens, logprobs
    # for each of them.
    out = srv.post(
        "/generate",
        {
            "input_ids": prompts[1],
            "sampling_params": {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True},
            "return_logprob": True,
        },
    )
    assert out["output_ids"] == want[1][:6] and len(out["meta_info"]["output_token_logprobs"]) == 6
    log = srv.log_tail(400)
    assert "Capture target decode CPU graph end" in log and "bs=[4]" in log, log
    assert re.search(r"decode batch size 4 captured \(torch.compile, eager\) in [\d.]+ s, [+-][\d.]+ MiB", log), log
    assert "first replay of the captured decode, batch size 4" in log, log
