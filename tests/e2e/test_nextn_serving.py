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
from spec_prompts import check_replay_pattern, replay_drafter, spec_prompts

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
    outs = _concurrent(srv, prompts)
    assert [o["output_ids"] for o in outs] == reference
    if extra:  # prefill chunks ran while requests were decoding: mixed steps happened
        assert re.search(r"Prefill batch.*#running-req: [1-9]", srv.log_since())


REPLAY = {
    "chain3": ["full", "partial:1", "zero", "cycle", "full", "partial:2", "zero", "full"],
    "tree4": ["full", "sibling", "zero", "cycle", "sibling", "partial:1", "full", "zero"],
}


def replay_server(servers, ckpt, replay_file, config):
    env = {settings.TEST_DRAFTER.name: replay_file(REPLAY[config])}
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


def _two_sample_p(a: Counter, b: Counter, top: int = 12) -> float:
    from scipy.stats import chi2_contingency

    keys = [k for k, _ in (a + b).most_common(top)]
    rows = [[c[k] for k in keys] + [sum(c.values()) - sum(c[k] for k in keys)] for c in (a, b)]
    rows = [[x for x, keep in zip(r, map(any, zip(*rows))) if keep] for r in rows]
    return chi2_contingency(rows)[1]


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
    accepted or rejected by rejection sampling, and the emitted tokens must be distributed as
    without speculation. 1600 samples per side (two-sample chi-square over the most frequent
    tokens, p > 1e-3) detect a 5 % shift of probability mass between tokens with high power."""
    prompt = prompts[0][:24]
    base_srv = servers.get(sharp_ckpt, *POOL, *WIDE)
    ref = base_srv.generate(prompt, 8)["output_ids"]
    base, _ = _samples(base_srv, prompt, 25, 64)
    env = {settings.TEST_DRAFTER.name: replay_drafter(tmp_path, [prompt], [ref], ["full"])}
    srv = spec_server(servers, sharp_ckpt, "chain3", "--random-seed", "1", *WIDE, env=env)
    spec, accepted = _samples(srv, prompt, 25, 64)
    assert len(base) == len(spec) == 1600
    # proposals of both outcomes: accepted drafts, and rounds where the first was rejected
    assert 200 < accepted < 0.9 * 3 * 1600, f"{accepted} accepted drafts"
    for pos in (1, 2):
        p = _two_sample_p(Counter(s[pos] for s in base), Counter(s[pos] for s in spec))
        assert p > 1e-3, f"token {pos + 1}: spec vs no-spec distributions differ (p = {p:.2e})"
    p = _two_sample_p(Counter(tuple(s[:2]) for s in base), Counter(tuple(s[:2]) for s in spec))
    assert p > 1e-3, f"tokens 1-2 jointly: p = {p:.2e}"
