import json
import os
import shutil
import sys
import tempfile
import time

import pytest

# Shared test helpers (prompts.py, e2e/pool.py, e2e/spec_prompts.py) import by plain module name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sglang_dsv4_ascend import settings  # noqa: E402

# The test-only settings (the replay drafter, the desync injection) are refused unless this is on;
# xdist workers and every server the tests start inherit it.
os.environ[settings.TESTING.name] = "1"

# A user's clone stands alone: nothing the tests run may read the development checkout's sibling
# folder `shared` (prompt sets and notes that users do not have). An audit hook records every
# file this process opens or lists there, and the session fails if there was any.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SIBLING = os.path.join(os.path.dirname(_REPO), "shared")
_outside: list = []


def _audit(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args:
        path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(path))
            if path == _SIBLING or path.startswith(_SIBLING + os.sep):
                _outside.append(path)


sys.addaudithook(_audit)


# -- checkpoints: each written once per test process ------------------------------------------------


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """(preset, draft) -> a tiny DeepSeek-V4 checkpoint directory (random weights, seed 0), written
    once per run and shared by every test that asks for the same. Do not modify it: copy it."""
    from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint

    dirs = {}

    def get(preset: str = "flash", draft: str = "dspark") -> str:
        if (preset, draft) not in dirs:
            dirs[preset, draft] = write_checkpoint(str(tmp_path_factory.mktemp(f"{preset}_{draft}")), preset, draft)
        return dirs[preset, draft]

    return get


@pytest.fixture(scope="session")
def w8a8_checkpoint(tiny_checkpoint, tmp_path_factory):
    """(preset, draft) -> its dynamic W8A8 version, written once per run by the quantize tool's
    command line (python -m sglang_dsv4_ascend.tools.quantize_w8a8 IN OUT --scheme dynamic)."""
    from sglang_dsv4_ascend.tools.quantize_w8a8 import main as quantize

    dirs = {}

    def get(preset: str = "flash", draft: str = "dspark") -> str:
        if (preset, draft) not in dirs:
            out = str(tmp_path_factory.mktemp(f"{preset}_{draft}_w8a8") / "w8a8")
            assert quantize([tiny_checkpoint(preset, draft), out, "--scheme", "dynamic", "--no-progress"]) in (0, None)
            dirs[preset, draft] = out
        return dirs[preset, draft]

    return get


# -- the budget: server starts and where the time went, printed at the end of every run -----------

_starts: list = []  # (seconds, "model flags") of every server this process started
_servers: list = []


def _count_server_starts():
    from sglang_dsv4_ascend.tools import server as srv_mod

    start = srv_mod.SGLangServer.start
    if getattr(start, "_counted", False):
        return

    def counted(self):
        t0 = time.monotonic()
        _servers.append(self)
        try:
            return start(self)
        finally:
            _starts.append((time.monotonic() - t0, " ".join([os.path.basename(self.model_path), *self.extra_args])))

    counted._counted = True
    srv_mod.SGLangServer.start = counted


_count_server_starts()


_STATS_ENV = settings.TEST_STATS_DIR.name  # set by the main pytest process, inherited by xdist workers


_zygote: list = []


def pytest_configure(config):
    if _STATS_ENV not in os.environ:
        os.environ[_STATS_ENV] = tempfile.mkdtemp(prefix="sglang-dsv4-tests-")
    if _runs_e2e(config):
        _start_zygote()


def _runs_e2e(config) -> bool:
    for arg in config.args or ["."]:
        path = os.path.abspath(arg.split("::")[0])
        e2e = os.path.join(_REPO, "tests", "e2e")
        if e2e.startswith(path + os.sep) or path == e2e or path.startswith(e2e + os.sep):
            return True
    return False


def _start_zygote():
    """Servers are forked from one process that imported SGLang once (tools/zygote.py says what
    that changes): a start costs ~6 s instead of ~30 s. It imports in the background while the
    tests are collected. SGLANG_DSV4_TEST_ZYGOTE=0 starts every server the plain way. Started by
    the main pytest process only; xdist workers and the tests' subprocesses inherit the variable."""
    from sglang_dsv4_ascend.tools import zygote

    if not settings.TEST_ZYGOTE.get() or settings.ZYGOTE.is_set():
        return
    d = tempfile.mkdtemp(prefix="sglang-dsv4-zygote-")
    _zygote.append(zygote.start(os.path.join(d, "sock"), os.path.join(d, "zygote.log")))
    os.environ[settings.ZYGOTE.name] = os.path.join(d, "sock")


def pytest_unconfigure(config):
    for proc in _zygote:
        proc.terminate()
        proc.wait(timeout=30)


def _stats_dir(config) -> str:
    return os.environ[_STATS_ENV]


def pytest_sessionfinish(session, exitstatus):
    if _outside:
        print(f"\nERROR: tests read outside the repository: {sorted(set(_outside))[:10]}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    for s in _servers:  # every server stopped, including those a failed test left running
        s.stop(wait=False)
    for s in _servers:
        s.join()
    d = _stats_dir(session.config)
    os.makedirs(d, exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.path.join(d, f"starts-{worker}.json"), "w") as f:
        json.dump(_starts, f)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if hasattr(config, "workerinput"):
        return
    d = _stats_dir(config)
    starts = []
    for name in sorted(os.listdir(d)) if os.path.isdir(d) else []:
        with open(os.path.join(d, name)) as f:
            starts += json.load(f)
    shutil.rmtree(d, ignore_errors=True)
    if not starts:
        return
    total = sum(s for s, _ in starts)
    tr = terminalreporter
    tr.section("server starts")
    tr.write_line(f"{len(starts)} SGLang server starts, {total:.0f} s starting them (summed over test processes)")
    for s, what in sorted(starts, reverse=True)[:5]:
        tr.write_line(f"  {s:6.1f} s  {what[:150]}")
