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
