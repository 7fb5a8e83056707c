"""The one table of `SGLANG_DSV4_*` settings (sglang_dsv4_ascend/settings.py): one parsing rule,
test-only settings refused outside the tests, and no reader that goes around the table."""

import ast
import pathlib

import pytest

from sglang_dsv4_ascend import settings

PACKAGE = pathlib.Path(settings.__file__).parent


@pytest.mark.parametrize(
    "raw,want",
    [
        ("1", True),
        ("true", True),
        (" Yes ", True),
        ("ON", True),
        ("0", False),
        ("false", False),
        ("no", False),
        ("Off", False),
        ("", None),
    ],
)
def test_one_truthiness_rule_for_every_flag(monkeypatch, raw, want):
    for s in (x for x in settings.SETTINGS if x.kind == "flag"):
        monkeypatch.setenv(s.name, raw)
        assert s.get() == (s.default if want is None else want), s.name


def test_values_outside_the_type_are_refused_naming_the_variable(monkeypatch):
    for s in settings.SETTINGS:
        bad = {"flag": "maybe", "int": "many", "choice": "bogus"}.get(s.kind)
        if bad is None:
            continue
        monkeypatch.setenv(s.name, bad)
        with pytest.raises(ValueError, match=f"{s.name}='{bad}': expected"):
            s.get()
    monkeypatch.setenv(settings.MAX_N.name, "0")
    with pytest.raises(ValueError, match="expected a positive integer"):
        settings.MAX_N.get()
    monkeypatch.setenv(settings.PREFIX_STATES.name, "0")
    with pytest.raises(ValueError, match="SGLANG_DSV4_PREFIX_STATES='0': expected a positive integer"):
        settings.PREFIX_STATES.get()
    monkeypatch.setenv(settings.ATTENTION.name, " Segments ")
    assert settings.ATTENTION.get() == "segments"
    monkeypatch.delenv(settings.MAX_REQUEST_BYTES.name, raising=False)
    assert settings.MAX_REQUEST_BYTES.get(default=123) == 123


def test_test_only_settings_need_the_test_switch(monkeypatch):
    only = [s for s in settings.SETTINGS if s.test_only]
    assert {s.name for s in only} == {"SGLANG_DSV4_TEST_DRAFTER", "SGLANG_DSV4_DEBUG_DESYNC_RANK"}
    monkeypatch.setenv(settings.TEST_DRAFTER.name, "replay:/nowhere.json")
    monkeypatch.setenv(settings.DEBUG_DESYNC_RANK.name, "1")
    for off in ("0", ""):
        monkeypatch.setenv(settings.TESTING.name, off)
        for s in only:
            with pytest.raises(ValueError, match=f"{s.name}=.*test-only setting, refused unless SGLANG_DSV4_TESTING=1"):
                s.get()
    monkeypatch.setenv(settings.TESTING.name, "1")
    assert settings.TEST_DRAFTER.get() == "replay:/nowhere.json" and settings.DEBUG_DESYNC_RANK.get() == 1


def test_the_replay_drafter_and_the_desync_are_refused_in_production(monkeypatch):
    from sglang_dsv4_ascend.distributed.spec_sync import RankSync
    from sglang_dsv4_ascend.speculative.drafters import make_drafter

    monkeypatch.delenv(settings.TESTING.name)
    monkeypatch.setenv(settings.TEST_DRAFTER.name, "replay:/nowhere.json")
    with pytest.raises(ValueError, match="SGLANG_DSV4_TEST_DRAFTER.*test-only"):
        make_drafter(object())
    monkeypatch.setenv(settings.DEBUG_DESYNC_RANK.name, "1")
    with pytest.raises(ValueError, match="SGLANG_DSV4_DEBUG_DESYNC_RANK.*test-only"):
        RankSync(rank=1, size=2).seed(0)


def _strings(tree):
    """String constants of a module that are not docstrings."""
    docs = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docs.add(id(first.value))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


def test_every_reader_goes_through_the_table():
    """No module but settings.py spells a setting's name in code (a reader or writer of the
    environment that bypasses the table's parsing), and every name the package mentions exists."""
    names = set(settings.BY_NAME)
    bypass, unknown = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        for word in set(__import__("re").findall(r"SGLANG_DSV4_[A-Z0-9_]*[A-Z0-9]", text)):
            if word not in names:
                unknown.append(f"{path.relative_to(PACKAGE)}: {word}")
        if path.name == "settings.py":
            continue
        for node in _strings(ast.parse(text)):
            if "SGLANG_DSV4_" in node.value:
                bypass.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value[:60]!r}")
    assert not bypass, "read through sglang_dsv4_ascend.settings instead:\n" + "\n".join(bypass)
    assert not unknown, "not in settings.SETTINGS:\n" + "\n".join(unknown)
