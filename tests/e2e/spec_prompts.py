"""Prompts for the speculative e2e tests: 8 requests with distinct 20-token prefixes (the replay
drafter tells requests apart by prefix), crossing the 16-token window, many 4-token blocks and,
while decoding, the 128-token block boundary (prompts of 110 and 124 tokens), plus one long
prompt (`long_end - 7` tokens: several prefill chunks)."""

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
