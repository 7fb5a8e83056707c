"""Prompts for tests and benchmarks: ../shared/data/prompts/*.jsonl ({"turns": [...]} per line)."""

from __future__ import annotations

import json
import os

_HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS_DIR = os.environ.get(
    "SGLANG_DSV4_PROMPTS_DIR", os.path.normpath(os.path.join(_HERE, "..", "..", "shared", "data", "prompts"))
)


def load_prompts(name: str, n: int, max_chars: int = 400) -> list[str]:
    path = os.path.join(PROMPTS_DIR, f"{name}.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"prompt set {path} not found; set SGLANG_DSV4_PROMPTS_DIR to the folder holding "
            f"gsm8k.jsonl / humaneval.jsonl / mt-bench.jsonl"
        )
    out = []
    with open(path) as f:
        for line in f:
            turns = json.loads(line)["turns"]
            out.append(turns[0][:max_chars])
            if len(out) == n:
                break
    return out
