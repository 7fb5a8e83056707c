import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from sglang_dsv4_ascend.tools.server import SGLangServer  # noqa: E402


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def tiny_llama(ckpt_root):
    from tiny_llama import write_tiny_llama

    return write_tiny_llama(str(ckpt_root / "tiny_llama"))


@pytest.fixture
def start_server(request):
    """Factory: start_server(model_path, *args, env=None) -> a running SGLangServer.

    Every server started through it is stopped at teardown, and its log is printed when the
    test failed.
    """
    servers = []

    def _start(model_path, *args, env=None):
        s = SGLangServer(model_path, *args, env=env)
        servers.append(s)
        return s.start()

    yield _start
    failed = getattr(request.node, "rep_call", None) is not None and request.node.rep_call.failed
    for s in servers:
        if failed:
            print(s.log_tail())
        s.stop()


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
