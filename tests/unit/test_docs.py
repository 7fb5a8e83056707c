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
            "paste the output of `python -m sglang_dsv4_ascend.settings`")
    documented = set(re.findall(r"SGLANG_DSV4_[A-Z0-9_]*[A-Z0-9]", text))
    assert documented <= set(settings.BY_NAME), documented - set(settings.BY_NAME)


def _register():
    """(numbers, names, kind, targets, params) of each hook section of patches/README.md."""
    text = (REPO / "patches" / "README.md").read_text()
    heads = list(re.finditer(r"^### ([\d, ]+)\. (.+?) — (\w+) (.+)$", text, re.M))
    out = []
    for k, m in enumerate(heads):
        section = text[m.end(): heads[k + 1].start() if k + 1 < len(heads) else len(text)]
        sig = re.search(r"\*\*Expected signature\*\*: `\((.*?)\)`", section, re.S)
        params = tuple(p.strip() for p in " ".join(sig.group(1).split()).split(",") if p.strip()) if sig else None
        out.append(([int(n) for n in m.group(1).split(",")], re.findall(r"`([^`]+)`", m.group(2)), m.group(3),
                    re.findall(r"`([^`]+)`", m.group(4)), params))
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
            h.name == "spec_stats_every_completion_chunk"), (h.name, h.body.__module__)
