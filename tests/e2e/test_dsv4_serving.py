"""DeepSeek-V4 served by a real SGLang server with the plugin: greedy output equals HF transformers'
DeepseekV4ForCausalLM (an independent implementation) token for token, in fp32, for prompts from
the packaged sets, under chunked prefill and concurrency, and an aborted request frees its cache;
left idle, the server does not burn a core."""

import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from prompts import load_prompts

pytestmark = pytest.mark.e2e

N_NEW = 10


@pytest.fixture(scope="module")
def tiny_dsv4(tiny_checkpoint):
    return tiny_checkpoint("flash", "dspark")


@pytest.fixture(scope="module")
def prompt_ids(tiny_dsv4):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dsv4)
    texts = load_prompts("gsm8k", 1) + load_prompts("humaneval", 1) + load_prompts("mt-bench", 1)
    ids = [tok(t).input_ids[:200] for t in texts]
    # One prompt long enough to span several 128-token HCA blocks and many 4-token CSA blocks.
    long = tok(" ".join(load_prompts("gsm8k", 6, max_chars=2000))).input_ids[:300]
    assert len(long) == 300 and all(len(i) > 20 for i in ids)  # all past the 16-token window
    return ids + [long]


def hf_greedy(model_path, prompts, n):
    """Greedy continuation by full recomputation each step: no cache, nothing shared with ours."""
    from transformers import DeepseekV4ForCausalLM

    m = DeepseekV4ForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32).eval()
    outs = []
    for ids in prompts:
        x, out = torch.tensor([ids]), []
        with torch.no_grad():
            for _ in range(n):
                nxt = int(m(x).logits[0, -1].argmax())
                out.append(nxt)
                x = torch.cat([x, torch.tensor([[nxt]])], dim=1)
        outs.append(out)
    return outs


def test_dsv4_greedy_equals_hf_with_concurrency_and_abort(tiny_dsv4, prompt_ids, servers):
    expected = hf_greedy(tiny_dsv4, prompt_ids, N_NEW)
    # Small prefill chunks: the 300-token prompt is prefilled in 5 chunks across batches.
    # Mixed chunks: decode tokens of running requests ride along with prefill chunks (MIXED mode).
    # The radix cache is off here: these prompts repeat, and hits would shorten the prefills whose
    # overlap with running decodes this test is about (hits are test_prefix_cache_serving.py's).
    srv = servers.get(tiny_dsv4, "--chunked-prefill-size", "128", "--enable-mixed-chunk", "--disable-radix-cache")
    # Idle before any request: SGLang's scheduler polls in a busy loop unless it sleeps on idle,
    # which the CPU platform turns on (measured: ~1.0 core without, ~0.02 with). Startup's own
    # work settles first (1 s windows, at most 20 s); a polling scheduler never settles.
    from sglang_dsv4_ascend.tools.server import idle_cores

    deadline = time.monotonic() + 20
    while idle_cores(srv, 1.0) >= 0.1 and time.monotonic() < deadline:
        pass
    idle = idle_cores(srv, 5.0)
    assert idle < 0.1, f"an idle server used {idle:.2f} cores"
    info = srv.server_info()
    assert info["sleep_on_idle"] is True
    assert info["attention_backend"] == "dsv4_ascend"
    assert info["disable_radix_cache"] is True  # --disable-radix-cache is honoured

    for ids, want in zip(prompt_ids, expected):
        assert srv.generate(ids, N_NEW, ignore_eos=True)["output_ids"] == want

    idle_used = srv.used_tokens()
    # A long request to abort mid-generation, running beside the concurrent ones.
    victim = {
        "input_ids": prompt_ids[0],
        "rid": "victim",
        "sampling_params": {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True},
    }
    victim_result = {}

    def run_victim():
        victim_result["out"] = srv.post("/generate", victim)

    t = threading.Thread(target=run_victim)
    t.start()
    deadline = time.monotonic() + 60
    while srv.used_tokens() <= idle_used + len(prompt_ids[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    busy = srv.used_tokens()
    assert busy > idle_used, "the victim request never held any cache"

    with ThreadPoolExecutor(len(prompt_ids)) as ex:
        futs = [ex.submit(srv.generate, ids, N_NEW, ignore_eos=True) for ids in prompt_ids]
        srv.post("/abort_request", {"rid": "victim"})
        outs = [f.result()["output_ids"] for f in futs]
    t.join(timeout=60)
    assert outs == expected
    # Prefill chunks ran while other requests were decoding (merged into MIXED batches).
    assert re.search(r"Prefill batch.*#running-req: [1-9]", srv.log_since())
    assert victim_result["out"]["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(victim_result["out"]["output_ids"]) < 4000

    deadline = time.monotonic() + 30
    while srv.used_tokens() != idle_used and time.monotonic() < deadline:
        time.sleep(0.2)
    assert srv.used_tokens() == idle_used
