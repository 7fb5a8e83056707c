"""Plugin loading contract: cheap import, the right platform choice, refusal outside the supported
SGLang range, and a doctor that tells the truth about it."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sglang_dsv4_ascend import settings


def _run(code, env=None):
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_import_is_cheap():
    r = _run("""
        import sys
        import sglang_dsv4_ascend, sglang_dsv4_ascend.plugin, sglang_dsv4_ascend.platforms
        import sglang_dsv4_ascend.integration.components, sglang_dsv4_ascend.integration.hooks
        import sglang_dsv4_ascend.device
        bad = [m for m in sys.modules if m.startswith(("torch_npu", "sglang.srt"))]
        print(bad)
    """)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


@pytest.mark.parametrize("mode,expect", [("auto", "cpu"), ("cpu", "cpu"), ("off", None)])
def test_platform_activation(monkeypatch, mode, expect):
    from sglang_dsv4_ascend import platforms

    monkeypatch.setenv(settings.PLATFORM.name, mode)
    got = platforms.activate()
    assert (got == platforms.CPU_PLATFORM) if expect == "cpu" else got is None


def test_platform_never_hijacks_an_accelerator(monkeypatch):
    from sglang_dsv4_ascend import device, platforms

    monkeypatch.setenv(settings.PLATFORM.name, "auto")
    monkeypatch.setattr(device, "accelerator", lambda: "cuda")
    assert platforms.activate() is None
    monkeypatch.setattr(device, "accelerator", lambda: None)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    assert platforms.activate() is None
    monkeypatch.setenv(settings.PLATFORM.name, "bogus")
    with pytest.raises(ValueError, match="SGLANG_DSV4_PLATFORM"):
        platforms.activate()


def _fake_sglang(tmp_path, version):
    """A dist-info that shadows the installed sglang's metadata, as a wrong install would."""
    d = tmp_path / f"sglang-{version}.dist-info"
    d.mkdir()
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    return {"PYTHONPATH": str(tmp_path) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_doctor_reports_supported_install():
    r = subprocess.run(
        [sys.executable, "-m", "sglang_dsv4_ascend.tools.doctor", "--json"], capture_output=True, text=True, timeout=300
    )
    rep = json.loads(r.stdout)
    assert r.returncode == 0 and rep["ok"], rep
    assert rep["sglang"]["supported"] and rep["sglang"]["version"].startswith("0.5.23")
    assert rep["device_family"] == "cpu" and rep["platform"].endswith("CpuReferencePlatform")
    assert rep["imports"]["triton"]["imports"] is True
    assert rep["imports"]["torch_npu"]["imports"] is False
    # the shipped trained tiny model is found where the package says it is
    import sglang_dsv4_ascend as pkg

    assert rep["tiny_model"]["present"] and rep["tiny_model"]["path"] == pkg.TINY_MODEL_PATH


@pytest.mark.parametrize("version", ["0.5.22", "0.6.0"])
def test_doctor_and_plugin_refuse_wrong_sglang(tmp_path, version):
    env = _fake_sglang(tmp_path, version)
    r = subprocess.run(
        [sys.executable, "-m", "sglang_dsv4_ascend.tools.doctor", "--json"],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=300,
    )
    rep = json.loads(r.stdout)
    assert r.returncode == 1 and not rep["ok"]
    assert rep["sglang"]["version"] == version and rep["sglang"]["supported"] is False
    assert any("outside sglang>=0.5.23,<0.5.24" in p for p in rep["problems"])

    r = _run("from sglang_dsv4_ascend.plugin import register; register()", env=env)
    assert r.returncode != 0
    assert f"installed sglang {version} is outside the supported range sglang>=0.5.23,<0.5.24" in r.stderr


def test_hook_signature_mismatch_is_refused():
    from sglang_dsv4_ascend.integration.compat import Hook, UnsupportedSGLang

    installed = []
    ok = Hook(
        "probe",
        "json:dumps",
        tuple(__import__("inspect").signature(json.dumps).parameters),
        "AROUND",
        lambda *a: installed.append(1),
    )
    ok.check()
    bad = Hook("probe", "json:dumps", ("obj",), "AROUND", lambda *a: installed.append(1))
    with pytest.raises(UnsupportedSGLang, match="json:dumps has parameters"):
        bad.check()
    missing = Hook("probe", "json:nope", (), "AROUND", lambda *a: None)
    with pytest.raises(UnsupportedSGLang, match="not found"):
        missing.check()


def test_scheduler_threads_leave_a_core_for_the_serving_processes(monkeypatch):
    from sglang_dsv4_ascend import settings
    from sglang_dsv4_ascend.platforms.threads import scheduler_threads

    THREADS_ENV = settings.CPU_THREADS.name

    monkeypatch.delenv(THREADS_ENV, raising=False)
    assert [scheduler_threads(c) for c in (1, 2, 3, 16)] == [1, 1, 2, 15]
    assert scheduler_threads(16, ranks=2) == 7 and scheduler_threads(2, ranks=4) == 1
    monkeypatch.setenv(THREADS_ENV, "3")
    assert scheduler_threads(2) == 3
    monkeypatch.setenv(THREADS_ENV, "0")
    with pytest.raises(ValueError, match="SGLANG_DSV4_CPU_THREADS='0': expected a positive integer"):
        scheduler_threads(2)
