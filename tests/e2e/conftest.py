import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from pool import PoolView, ServerPool  # noqa: E402

from sglang_dsv4_ascend.tools.server import SGLangServer  # noqa: E402


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpts")


@pytest.fixture(scope="session")
def tiny_llama(ckpt_root):
    from tiny_llama import write_tiny_llama

    return write_tiny_llama(str(ckpt_root / "tiny_llama"))


_pool: list = []  # the session's ServerPool, once a test asked for it


@pytest.fixture(scope="session")
def tiny_w8a8(ckpt_root):
    """(kind "dspark" | "nextn", float_draft) -> the shipped trained tiny model quantized by the tool
    (W8A8 dynamic; the draft too unless float_draft), written once per test process."""
    import sglang_dsv4_ascend as pkg
    from sglang_dsv4_ascend.tools.quantize_w8a8 import quantize_checkpoint

    dirs = {}

    def get(kind: str = "dspark", float_draft: bool = False) -> str:
        if (kind, float_draft) not in dirs:
            src = pkg.TINY_MODEL_PATH if kind == "dspark" else pkg.TINY_NEXTN_MODEL_PATH
            out = os.path.join(ckpt_root, f"tiny_w8a8_{kind}{'_float_draft' if float_draft else ''}")
            quantize_checkpoint(src, out, progress=False, float_draft=float_draft)
            dirs[kind, float_draft] = out
        return dirs[kind, float_draft]

    return get


@pytest.fixture(scope="session")
def server_pool():
    pool = ServerPool()
    _pool.append(pool)
    yield pool
    pool.close()


def _group(item):
    mark = item.get_closest_marker("xdist_group") if item is not None else None
    return mark.args[0] if mark else None


def pytest_runtest_teardown(item, nextitem):
    """The pooled servers go when the next test of this process is in another group (or none is
    known yet): they would sit idle, holding memory and (DP controllers) a core."""
    if _pool and (nextitem is None or _group(nextitem) != _group(item)):
        _pool[0].release()


@pytest.fixture
def servers(request, server_pool):
    """servers.get(model, *flags, env=None) -> a running server shared with every other test
    that asks for the same (tests/e2e/pool.py says when a test must own its server instead).
    The logs of the servers a failed test used are printed."""
    view = PoolView(server_pool)
    yield view
    if _failed(request):
        for s in view.used:
            print(s.log_tail())


@pytest.fixture
def start_server(request):
    """Factory for servers a test owns: start_server(model_path, *args, env=None, zygote=None) -> a running
    SGLangServer, stopped at teardown (without waiting for SGLang's shutdown); its log is printed
    when the test failed. Use it only where a shared server cannot do (tests/e2e/pool.py)."""
    owned = []

    def _start(model_path, *args, env=None, zygote=None):
        if _pool:  # one server at a time per test process: the pooled one is not needed meanwhile
            _pool[0].release()
        s = SGLangServer(model_path, *args, env=env, zygote=zygote)
        owned.append(s)
        return s.start()

    yield _start
    failed = _failed(request)
    for s in owned:
        if failed:
            print(s.log_tail())
        s.stop(wait=False)


def _failed(request) -> bool:
    rep = getattr(request.node, "rep_call", None)
    return rep is not None and rep.failed


# The end-to-end run order, as (group, test id prefix): the users of each shared server side by side
# (tests/e2e/pool.py), the longest group first. `scripts/test.sh` sends each group to one of two
# pytest-xdist workers (--dist loadgroup) and the unit tests to whichever is free
# (SGLANG_DSV4_TEST_WORKERS=0: one process, this order). A test not listed runs last, in its own
# group.
FUZZ = "test_request_boundary.py::test_request_fuzz_never_breaks_the_server"
SCHEDULE = [
    # DeepSeek-V4 across ranks (multi-process servers): the random checkpoint's layouts, the random
    # W8A8 checkpoint's one-rank server first
    ("ranks", "test_w8a8_serving.py"),
    ("ranks", "test_parallel_serving.py::test_w8a8_on"),
    ("ranks", "test_parallel_serving.py::test_w8a8_with"),
    ("ranks", "test_parallel_serving.py::test_tp2_and_ep2"),
    ("ranks", "test_parallel_serving.py::test_data_parallel"),
    ("ranks", "test_parallel_serving.py::test_a_layout"),
    # speculation across ranks on the trained model (one group with the above: two multi-rank
    # servers at once on two cores starve each other's collectives); the boundary fuzz right after
    # the two-rank DSpark server's own test
    ("ranks", "test_parallel_serving.py::test_speculation_on_two_ranks_is_lossless_and_in_sync[nextn_"),
    ("ranks", "test_parallel_serving.py::test_speculation_on_two_ranks_is_lossless_and_in_sync[dspark_adaptive-dp2]"),
    ("ranks", f"{FUZZ}[dspark_adaptive_tp2]"),
    ("ranks", "test_parallel_serving.py"),
    ("ranks", "test_indexcache_serving.py::test_served_freq2_equals_in_process[nospec_tp2]"),
    # the trained model's methods, each server's users together: first the README's configuration
    # (DSpark adaptive), whose server starts cold (tests/e2e/pool.py) and so at the start, while the
    # other worker runs one-rank servers (during four-rank ones it took 180 s instead of ~60)
    ("spec", "test_trained_tiny.py::test_the_completion"),
    *[
        entry
        for method in ("dspark_adaptive", "nextn_chain", "nextn_tree2", "nextn_tree4", "dspark_static")
        for entry in (
            *[
                ("spec", f"{test}[{method}]")
                for test in (
                    "test_trained_tiny.py::test_greedy_equals_no_speculation_and_drafts_are_accepted",
                    "test_prefix_cache_serving.py::test_speculative_prefix_hit_drafts_like_cold",
                    FUZZ,
                )
            ],
            *((("spec", "test_bench_serve.py"),) if method == "dspark_adaptive" else ()),  # its server too
        )
    ],
    # DSpark on the random checkpoint
    ("spec", "test_dspark_serving.py"),
    # the trained model's W8A8 version: its no-speculation server first, then with speculation
    ("spec", "test_trained_tiny.py::test_captured_verify"),
    ("spec", "test_trained_tiny.py::test_nextn_tree_with_graphs"),
    ("spec", "test_trained_tiny.py::test_w8a8_version_serves"),
    ("spec", "test_w8a8_speculation.py"),
    ("spec", "test_trained_tiny.py"),
    ("spec", "test_indexcache_serving.py"),  # IndexCache servers of their own (freq 2)
    # prefill/decode disaggregation: pairs of its own (and the unified reference server); early, so
    # that a long group does not end the run
    ("pd", "test_pd_serving.py"),
    # NextN and the prefix cache on the random NextN checkpoint; boundaries and startup refusals
    ("nextn", "test_nextn_serving.py"),
    ("nextn", "test_prefix_cache_serving.py"),
    ("nextn", "test_request_boundary.py"),
    ("nextn", "test_dsv4_serving.py"),
    ("nextn", "test_platform_serving.py"),
    ("nextn", "test_dsv4_bad_input.py"),
    ("nextn", "test_graph_serving.py"),
    # the shipped model in bf16 (its own servers: one reference, every method)
    ("bf16", "test_bf16_lossless.py"),
]


def _slot(item) -> int:
    rel = item.nodeid.rsplit("e2e/", 1)[-1]
    return next((i for i, (_, prefix) in enumerate(SCHEDULE) if rel.startswith(prefix)), len(SCHEDULE))


def pytest_itemcollected(item):
    """Mark each e2e test with its group as it is collected (xdist reads the mark in its own
    collection hook, which may run before any reordering)."""
    if "/e2e/" not in f"/{item.nodeid}":
        return
    item.add_marker(pytest.mark.e2e)  # every test in this folder, whether or not its file says so
    i = _slot(item)
    item.add_marker(pytest.mark.xdist_group(SCHEDULE[i][0] if i < len(SCHEDULE) else item.nodeid))


def pytest_collection_modifyitems(config, items):
    """The e2e tests first, in SCHEDULE order, then the unit tests: under xdist (scripts/test.sh
    passes --no-loadscope-reorder) the first groups (the longest first) start at once on the
    workers, and the unit tests fill in behind them."""
    e2e = [it for it in items if "/e2e/" in f"/{it.nodeid}"]
    if e2e:
        e2e_ids = set(map(id, e2e))
        items[:] = sorted(e2e, key=_slot) + [it for it in items if id(it) not in e2e_ids]


@pytest.hookimpl(tryfirst=True, hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, "rep_" + rep.when, rep)
