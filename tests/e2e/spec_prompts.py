"""Prompts for the speculative e2e tests: 8 requests with distinct 20-token prefixes (the replay
drafter tells requests apart by prefix), crossing the 16-token window, many 4-token blocks and,
while decoding, the 128-token block boundary (prompts of 110 and 124 tokens), plus one long
prompt (`long_end - 7` tokens: several prefill chunks). Also the replay drafter's file, and the
acceptance pattern each replay mode must produce."""

import json

from prompts import load_prompts


def spec_prompts(ckpt, long_end: int):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    ids = tok(" ".join(load_prompts("gsm8k", 8, max_chars=2000))).input_ids
    # humaneval prompts share a long instruction prefix: take their (distinct) ends
    short = [tok(t).input_ids[-40:] for t in load_prompts("humaneval", 2)]
    short += [tok(t).input_ids[:40] for t in load_prompts("mt-bench", 2)]
    out = short + [ids[:110], ids[120:244], ids[7:long_end], ids[50:90]]
    assert len(out) == 8 and all(len(p) > 20 for p in out)
    assert len({tuple(p[:20]) for p in out}) == 8
    return out


# Tests that assert each round's acceptance pattern or verify width serve without the speculation
# guard (speculative/guard.py): its plain steps (no drafts) interleave by the machine's timings.
EXACT_ROUNDS = {"SGLANG_DSV4_SPEC_GUARD": "0"}


def replay_drafter(tmp_path, prompts, reference, modes) -> str:
    """SGLANG_DSV4_TEST_DRAFTER's value for a replay drafter proposing each prompt's reference continuation
    in `modes` (full, partial:N, zero, sibling, cycle), one per prompt."""
    path = tmp_path / "replay.json"
    path.write_text(json.dumps({"sequences": [p + r for p, r in zip(prompts, reference)], "modes": modes}))
    return f"replay:{path}"


def check_replay_pattern(out, mode: str, steps: int) -> None:
    """A NextN request's correct drafts per round (from its histogram) follow its replay mode."""
    h, ct = out["meta_info"]["spec_correct_drafts_histogram"], out["meta_info"]["spec_verify_ct"]
    assert sum(h) == ct > 0, (mode, h)
    correct = [k for k, n in enumerate(h) for _ in range(n)]  # correct drafts of each round
    body = correct[:-1]  # the last round may be cut by max_new_tokens
    if mode == "full":
        assert all(c == steps for c in body), (mode, h)
    elif mode == "zero":
        assert all(c == 0 for c in correct), (mode, h)
    elif mode.startswith("partial:"):
        assert all(c == int(mode[8:]) for c in body), (mode, h)
    elif mode == "sibling":
        # the correct token is always the second child: accepted past a rejected first sibling
        assert body and all(c >= 1 for c in body), (mode, h)
    elif mode == "cycle":
        assert {0, 1, steps} <= set(correct), (mode, h)
    else:
        raise ValueError(f"unknown replay mode {mode!r}")


def spec_record(srv) -> dict:
    """The server's speculative statistics (speculative/stats.py) of rank 0."""
    state = srv.server_info()["internal_states"][0]
    return state.get("dspark_info_record") or state["nextn_info_record"]


def accepted_per_drafting_round(before: dict, after: dict) -> float:
    """Mean accepted drafts per request-round that drafted, between two `spec_record`s: the
    guard's plain steps (speculative/guard.py) draft nothing and are left out."""
    rounds = after["drafting_request_rounds"] - before["drafting_request_rounds"]
    assert rounds > 0, ("no round drafted", after.get("rounds_by_guard"))
    return (after["accepted_drafts"] - before["accepted_drafts"]) / rounds


def accepted_per_round(meta) -> float:
    """Mean accepted drafts per verify round, from the round histogram SGLang reports."""
    h = meta["spec_correct_drafts_histogram"]
    return sum(k * n for k, n in enumerate(h)) / max(1, sum(h))
