"""The repository stands alone: a user's clone has no development sibling folder (`shared`) beside it,
so no tracked file may point there and the prompt sets the tests and benchmarks use ship in the
package. (tests/conftest.py also fails the session if any test opens a file there.)"""

import os
import subprocess

from sglang_dsv4_ascend import data, settings

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_no_tracked_file_points_outside_the_repository():
    needles = ["../" + "shared", "shared/" + "data", "shared/" + "docs"]
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    hits = []
    for rel in files:
        try:
            text = open(os.path.join(REPO, rel), encoding="utf-8").read()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        hits += [f"{rel}: {n}" for n in needles if n in text]
    assert not hits, hits


def test_prompt_sets_ship_in_the_package(monkeypatch):
    monkeypatch.delenv(settings.PROMPTS_DIR.name, raising=False)
    assert data.prompts_dir().startswith(os.path.join(REPO, "sglang_dsv4_ascend"))
    assert os.path.exists(os.path.join(data.PACKAGED_PROMPTS_DIR, "LICENSE-DeepSpec"))
    for name in data.PROMPT_SETS:
        prompts = data.load_prompts(name, None, None)
        assert len(prompts) >= 50 and all(isinstance(p, str) and p for p in prompts), name
    assert data.load_prompts("gsm8k", 3, 20) == [p[:20] for p in data.load_prompts("gsm8k", 3, None)]


def test_prompts_dir_override(monkeypatch, tmp_path):
    (tmp_path / "mine.jsonl").write_text('{"turns": ["first", "second"]}\n\n{"turns": ["again"]}\n')
    monkeypatch.setenv(settings.PROMPTS_DIR.name, str(tmp_path))
    assert data.load_prompts("mine") == ["first", "again"]
    try:
        data.load_prompts("gsm8k")
    except FileNotFoundError as e:
        assert "SGLANG_DSV4_PROMPTS_DIR" in str(e) and "gsm8k" in str(e)
    else:
        raise AssertionError("a missing set must name the override")
