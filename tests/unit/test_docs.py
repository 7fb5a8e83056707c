"""The docs say what the code does: the README's settings tables are the settings table's."""

import pathlib
import re

from sglang_dsv4_ascend import settings

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_readme_settings_tables_are_the_settings_table():
    text = (REPO / "README.md").read_text()
    for group in ("server", "harness"):
        m = re.search(r"<!-- settings: " + group + r"[^\n]*-->\n(.*?)\n<!-- end settings -->", text, re.S)
        assert m, f"README.md has no generated '{group}' settings table"
        assert m.group(1) == settings.markdown_table(group), (
            f"README.md's {group} settings table differs from sglang_dsv4_ascend/settings.py; "
            "paste the output of `python -m sglang_dsv4_ascend.settings`"
        )
    documented = set(re.findall(r"SGLANG_DSV4_[A-Z0-9_]*[A-Z0-9]", text))
    assert documented <= set(settings.BY_NAME), documented - set(settings.BY_NAME)


def _register():
    """(numbers, names, kind, targets, params) of each hook section of patches/README.md."""
    text = (REPO / "patches" / "README.md").read_text()
    heads = list(re.finditer(r"^### ([\d, ]+)\. (.+?) — (\w+) (.+)$", text, re.M))
    out = []
    for k, m in enumerate(heads):
        section = text[m.end() : heads[k + 1].start() if k + 1 < len(heads) else len(text)]
        sig = re.search(r"\*\*Expected signature\*\*: `\((.*?)\)`", section, re.S)
        params = tuple(p.strip() for p in " ".join(sig.group(1).split()).split(",") if p.strip()) if sig else None
        out.append(
            (
                [int(n) for n in m.group(1).split(",")],
                re.findall(r"`([^`]+)`", m.group(2)),
                m.group(3),
                re.findall(r"`([^`]+)`", m.group(4)),
                params,
            )
        )
    return out


def test_patches_register_is_what_is_installed():
    """patches/README.md lists every installed hook, in order, with its name, kind, target and
    signature as the code declares them (integration/hooks/<name>.py)."""
    from sglang_dsv4_ascend.integration.hooks import HOOKS

    documented = []
    for numbers, names, kind, targets, params in _register():
        assert len(numbers) == len(names) == len(targets), (numbers, names, targets)
        documented += [(n, name, kind, target, params) for n, name, target in zip(numbers, names, targets)]
    installed = [(i + 1, h.name, h.kind, h.target.replace(":", "."), h.params) for i, h in enumerate(HOOKS)]
    assert documented == installed
    for h in HOOKS:
        assert h.body.__module__ == f"sglang_dsv4_ascend.integration.hooks.{h.name}" or (
            h.name == "spec_stats_every_completion_chunk"
        ), (h.name, h.body.__module__)


DOCS = ("docs/ARCHITECTURE.md", "README.md", "patches/README.md")
EXTENSIONS = (".py", ".md", ".json", ".jsonl", ".sh", ".toml", ".png", ".txt", ".safetensors")


def _path_like(token: str) -> bool:
    if token.startswith(("/", "$", "~", "-", ".")) or "://" in token or "<" in token or "=" in token:
        return False
    return "/" in token or token.endswith(EXTENSIONS)


def _named_paths(name: str) -> set:
    """Backticked path-like tokens of a doc; for ARCHITECTURE.md also the paths in its code blocks."""
    text = (REPO / name).read_text()
    found = set(re.findall(r"`([^`\s]+)`", text))
    if name == "docs/ARCHITECTURE.md":
        for block in re.findall(r"(?:^    .*\n)+", text, re.M):
            found |= set(re.findall(r"[\w./-]+/[\w.-]*|[\w/-]+\.(?:py|md)\b", block))
    return {t for t in found if _path_like(t)}


def _exists(token: str, roots: list, basenames: set) -> bool:
    token = re.sub(r"::.*$|:\d+(-\d+)?$", "", token).rstrip(",.;:)")
    if "/" not in token:
        return token in basenames
    head, _, last = token.rpartition("/")
    candidates = [token, token + ".py"]
    if "." in last and not last.endswith(EXTENSIONS):  # a module path with an attribute: `a/b.name`
        candidates.append(f"{head}/{last.split('.')[0]}.py")
    return any(list(root.glob(c)) for root in roots for c in candidates)


def test_docs_name_only_paths_that_exist():
    """docs/ARCHITECTURE.md, README.md and patches/README.md name only paths that exist: in the
    repository (from its root, `sglang_dsv4_ascend/` or `tests/`) or, for SGLang's own files, in
    the installed `sglang/srt/`. `a/b.name` is `a/b.py`'s attribute; a bare file name exists
    somewhere in the repository."""
    import importlib.util

    sglang = pathlib.Path(importlib.util.find_spec("sglang").submodule_search_locations[0])
    roots = [REPO, REPO / "sglang_dsv4_ascend", REPO / "tests", sglang / "srt", sglang]
    basenames = {p.name for p in REPO.rglob("*") if ".git" not in p.parts}
    missing = [f"{name}: {t}" for name in DOCS for t in sorted(_named_paths(name)) if not _exists(t, roots, basenames)]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_the_docs_check_catches_a_missing_path(tmp_path):
    roots, basenames = [REPO, REPO / "sglang_dsv4_ascend"], {"README.md"}
    assert _exists("platforms/cpu.py", roots, basenames) and _exists("integration/hooks/", roots, basenames)
    assert _exists("integration/request_guard.check_request", roots, basenames)
    for gone in ("platforms/ascend.py", "speculative/budget.py", "metrics/", "tests/multi/", "e2e/server.py"):
        assert not _exists(gone, roots, basenames), gone
