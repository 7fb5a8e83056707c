"""`--speculative-algorithm nextn` through real SGLang servers on the tiny DeepSeek-V4 (fp32):
greedy output equals serving without speculation token for token, as a chain and as trees (topk 2
and 4), single and 8 concurrent requests, with chunked prefill; with the real NextN head (random
weights: it is almost never right) and with the test replay drafter driving full, partial, zero and
non-first-sibling acceptance on purpose; aborting mid-speculation frees the cache; sampled output
at temperature 0.8 is distributed like serving without speculation.

Prompts cross the 16-token window, many 4-token blocks and (near 128 and 300 tokens) a 128-token
block boundary while the server is drafting and verifying.
"""

import json
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
from spec_prompts import EXACT_ROUNDS, check_replay_pattern, replay_drafter, spec_prompts

from sglang_dsv4_ascend import settings

pytestmark = pytest.mark.e2e

N_NEW = 24
POOL = ("--max-total-tokens", "32768")  # trees reserve topk pages per request per round (SGLang sizing)
CONFIGS = {
    "chain3": ("--speculative-num-steps", "3", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"),
    "tree2": ("--speculative-num-steps", "3", "--speculative-eagle-topk", "2", "--speculative-num-draft-tokens", "6"),
    "tree4": ("--speculative-num-steps", "3", "--speculative-eagle-topk", "4", "--speculative-num-draft-tokens", "8"),
}


def spec_server(servers, ckpt, config, *args, env=None):
    return servers.get(ckpt, *POOL, "--speculative-algorithm", "nextn", *CONFIGS[config], *args, env=env)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint):
    return tiny_checkpoint("flash", "nextn")


@pytest.fixture(scope="module")
def prompts(ckpt):
    return spec_prompts(ckpt, 307)


@pytest.fixture(scope="module")
def reference(server_pool, ckpt, prompts):
    srv = server_pool.get(ckpt, *POOL)
    return [srv.generate(p, N_NEW, ignore_eos=True)["output_ids"] for p in prompts]


@pytest.fixture(scope="module")
def replay_file(tmp_path_factory, prompts, reference):
    """The replay drafter's file for `modes`, written once per set of modes (the servers that
    read it are shared: the same modes give the same file path, hence the same server)."""
    files = {}

    def get(modes):
        if tuple(modes) not in files:
            files[tuple(modes)] = replay_drafter(tmp_path_factory.mktemp("replay"), prompts, reference, modes)
        return files[tuple(modes)]

    return get


def _concurrent(srv, prompts, **kw):
    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(lambda p: srv.generate(p, N_NEW, ignore_eos=True, **kw), prompts))


@pytest.mark.parametrize("config", list(CONFIGS))
def test_greedy_nextn_equals_no_speculation(servers, ckpt, prompts, reference, config):
    """The real NextN head, single and 8 concurrent requests; the chain server also prefills in
    128-token chunks with mixed chunks: running requests then ride along a prefill chunk as plain
    one-token decodes (SGLang's spec-v2 mixed step), and their draft state comes from that step."""
    # (radix cache off for the mixed-step server: the repeated prompts would hit, and the shorter
    # prefills would not overlap the decodes this checks; hits under speculation are
    # test_prefix_cache_serving.py's)
    extra = (
        ("--chunked-prefill-size", "128", "--enable-mixed-chunk", "--disable-radix-cache") if config == "chain3" else ()
    )
    srv = spec_server(servers, ckpt, config, *extra)
    assert "dsv4_ascend NextN worker" in srv.log_text()
    for p, want in zip(prompts[:3], reference):
        out = srv.generate(p, N_NEW, ignore_eos=True)
        assert out["output_ids"] == want
        assert out["meta_info"]["spec_verify_ct"] > 0
    before = srv.server_info()["internal_states"][0]["nextn_info_record"]
    outs = _concurrent(srv, prompts)
    assert [o["output_ids"] for o in outs] == reference
    # the worker's record in /get_server_info (hook nextn_info_record) counts exactly these
    # requests' verify rounds, and times every stage
    rec = srv.server_info()["internal_states"][0]["nextn_info_record"]
    assert rec["request_rounds"] - before["request_rounds"] == sum(o["meta_info"]["spec_verify_ct"] for o in outs)
    assert rec["rounds"] > before["rounds"] and rec["stage_ms_per_round"]["verify"] > 0, rec
    if extra:  # prefill chunks ran while requests were decoding: mixed steps happened
        assert re.search(r"Prefill batch.*#running-req: [1-9]", srv.log_since())


REPLAY = {
    "chain3": ["full", "partial:1", "zero", "cycle", "full", "partial:2", "zero", "full"],
    "tree4": ["full", "sibling", "zero", "cycle", "sibling", "partial:1", "full", "zero"],
}


def replay_server(servers, ckpt, replay_file, config):
    env = {settings.TEST_DRAFTER.name: replay_file(REPLAY[config]), **EXACT_ROUNDS}
    return spec_server(servers, ckpt, config, "--chunked-prefill-size", "128", env=env)


@pytest.mark.parametrize("config", list(REPLAY))
def test_replay_drives_full_partial_and_zero_acceptance(servers, ckpt, prompts, reference, replay_file, config):
    modes = REPLAY[config]
    steps = 3
    srv = replay_server(servers, ckpt, replay_file, config)
    assert "TEST replay drafter" in srv.log_text()
    outs = _concurrent(srv, prompts)
    assert [o["output_ids"] for o in outs] == reference
    for mode, out in zip(modes, outs):
        check_replay_pattern(out, mode, steps)


def test_abort_mid_speculation_frees_the_cache(servers, ckpt, prompts, reference, replay_file):
    """On the replay tree4 server (shared with the replay test; the victim's mode is full: every
    round commits a whole path, so its cache grows round by round until the abort)."""
    srv = replay_server(servers, ckpt, replay_file, "tree4")
    idle = srv.used_tokens()
    victim = {
        "input_ids": prompts[0],
        "rid": "victim",
        "sampling_params": {"max_new_tokens": 4000, "temperature": 0.0, "ignore_eos": True},
    }
    result = {}
    t = threading.Thread(target=lambda: result.setdefault("out", srv.post("/generate", victim)))
    t.start()
    deadline = time.monotonic() + 60
    while srv.used_tokens() <= idle + len(prompts[0]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert srv.used_tokens() > idle, "the victim never held any cache"
    # several speculative rounds: the victim's cache grows past its prompt by 3 round's worth
    held = srv.used_tokens()
    while srv.used_tokens() < held + 3 * 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.used_tokens() >= held + 3 * 4, "the victim made no speculative progress"
    srv.post("/abort_request", {"rid": "victim"})
    t.join(timeout=60)
    out = result["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert out["meta_info"]["spec_verify_ct"] > 0
    deadline = time.monotonic() + 30
    while srv.used_tokens() != idle and time.monotonic() < deadline:
        time.sleep(0.2)
    assert srv.used_tokens() == idle
    # the server still serves, losslessly
    assert srv.generate(prompts[1], N_NEW, ignore_eos=True)["output_ids"] == reference[1]


def _samples(srv, prompt, n_requests, n_per):
    """Tokens 2 and 3 of `n_requests * n_per` sampled completions (token 1 comes from the prefill's
    sampler; tokens 2.. from speculative rounds)."""

    def one(_):
        out = srv.post(
            "/generate",
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": 3, "temperature": 0.8, "n": n_per, "ignore_eos": True},
            },
        )
        return out if isinstance(out, list) else [out]

    with ThreadPoolExecutor(4) as ex:
        outs = [o for batch in ex.map(one, range(n_requests)) for o in batch]
    correct = sum(o["meta_info"].get("spec_num_correct_drafts", 0) for o in outs)
    return [o["output_ids"] for o in outs], correct


def _exact_joints(model_path, prompt, depth: int, temperature: float, min_p: float) -> list:
    """For d = 1..depth, the target's exact probability of each sequence of the first d sampled
    tokens above `min_p` (expanded prefix by prefix, one plain forward each): the distribution
    served output must follow, speculation or not."""
    import torch

    from sglang_dsv4_ascend.batch import Segment
    from sglang_dsv4_ascend.models.weights import load_model_from_dir

    model = load_model_from_dir(model_path)
    cells, out = {(): 1.0}, []
    for _ in range(depth):
        nxt = {}
        for seq, p in cells.items():
            ids = list(prompt) + list(seq)
            cache = model.make_cache(1, len(ids) + 1)
            logits = model.compute_logits(
                model(torch.tensor(ids), torch.arange(len(ids)), [Segment(0, 0, len(ids))], cache)
            )
            probs = torch.softmax(logits[-1].double() / temperature, -1)
            for t in torch.nonzero(p * probs > min_p).flatten().tolist():
                nxt[seq + (t,)] = p * float(probs[t])
        cells = nxt
        out.append(cells)
    return out


def _goodness_of_fit_p(samples, cells: dict) -> float:
    """Chi-square of the observed sequences against `cells` (exact probabilities; every other
    sequence lumped into one cell)."""
    from scipy.stats import chisquare

    counts = Counter(map(tuple, samples))
    n = len(samples)
    keys = list(cells)
    observed = [counts[k] for k in keys] + [n - sum(counts[k] for k in keys)]
    expected = [n * cells[k] for k in keys] + [n * (1 - sum(cells.values()))]
    return chisquare(observed, expected).pvalue


@pytest.fixture(scope="module")
def sharp_ckpt(ckpt, tmp_path_factory):
    """The tiny checkpoint with its head scaled x3: random weights give a flat next-token
    distribution (largest probability ~0.04 at T = 0.8), against which almost no proposal is ever
    accepted; scaled, the most likely token has ~0.6 and proposals are accepted and rejected."""
    import shutil

    from safetensors.torch import load_file, save_file

    out = tmp_path_factory.mktemp("sharp") / "flash"
    shutil.copytree(ckpt, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    shard = out / index["head.weight"]
    tensors = load_file(str(shard))
    tensors["head.weight"] = tensors["head.weight"] * 3
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return str(out)


# 64 samples per request in batches of 64 (the CPU default of 16 running requests would take four
# times the steps for the same samples)
WIDE = ("--max-running-requests", "64")


def test_sampled_speculation_matches_the_target_distribution(servers, sharp_ckpt, prompts, tmp_path):
    """Temperature 0.8 with the replay drafter proposing the greedy continuation: proposals are
    accepted or rejected by rejection sampling, and the emitted tokens must follow the target's
    distribution, computed exactly in process (every sequence of the first 2 and 3 tokens with
    an expected count of 10 or more, the rest lumped). 1600 samples (chi-square goodness of fit,
    p > 1e-3) detect a 5 % shift of probability mass between tokens with high power."""
    from sglang_dsv4_ascend.models.weights import load_model_from_dir
    from tests.oracles.decode import plain_greedy

    prompt = prompts[0][:24]
    ref = plain_greedy(load_model_from_dir(sharp_ckpt), [prompt], 8)[0]
    env = {settings.TEST_DRAFTER.name: replay_drafter(tmp_path, [prompt], [ref], ["full"])}
    srv = spec_server(servers, sharp_ckpt, "chain3", "--random-seed", "1", *WIDE, env=env)
    spec, accepted = _samples(srv, prompt, 25, 64)
    assert len(spec) == 1600
    # proposals of both outcomes: accepted drafts, and rounds where the first was rejected
    assert 200 < accepted < 0.9 * 3 * 1600, f"{accepted} accepted drafts"
    joints = _exact_joints(sharp_ckpt, prompt, 3, 0.8, min_p=10 / len(spec))
    for depth in (2, 3):
        cells = joints[depth - 1]
        assert len(cells) >= 3, cells  # a test with power: several sequences, each expected 10+ times
        p = _goodness_of_fit_p([s[:depth] for s in spec], cells)
        assert p > 1e-3, f"tokens 1-{depth}: served speculation vs the exact distribution, p = {p:.2e}"
