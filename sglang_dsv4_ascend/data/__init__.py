"""Prompt sets shipped with the package, for tests, benchmarks, calibration and the demo.

`prompts/{gsm8k,humaneval,mt-bench}.jsonl` are DeepSpec's evaluation sets (one JSON object per line,
`{"turns": [...]}`; MIT license in `prompts/LICENSE-DeepSpec`). They ship inside the package so a
clone, an installed wheel and CI all read the same files and nothing outside the repository.
`SGLANG_DSV4_PROMPTS_DIR` points the loader at another folder of the same format.
"""

from __future__ import annotations

import json
import os

from .. import settings

PACKAGED_PROMPTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts")
PROMPT_SETS = ("gsm8k", "humaneval", "mt-bench")


def prompts_dir() -> str:
    return settings.PROMPTS_DIR.get() or PACKAGED_PROMPTS_DIR


def prompt_path(name: str) -> str:
    path = os.path.join(prompts_dir(), f"{name}.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(
            f"prompt set {name!r}: {path} not found (sets: {', '.join(PROMPT_SETS)}; "
            f"{settings.PROMPTS_DIR.name} overrides the folder)"
        )
    return path


def load_prompts(name: str, n: int | None = None, max_chars: int | None = 400) -> list[str]:
    """The first turn of the first `n` entries of a prompt set (all when n is None), each cut to
    `max_chars` characters (None: whole)."""
    out = []
    with open(prompt_path(name), encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            turn = json.loads(line)["turns"][0]
            out.append(turn if max_chars is None else turn[:max_chars])
            if n is not None and len(out) == n:
                break
    return out
