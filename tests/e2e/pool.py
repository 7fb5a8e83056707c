"""Servers shared across the whole test run: one running SGLang server per (checkpoint, flags,
environment), started on first use and handed to every later test that asks for the same.

A server start costs 20-60 s on the 2-core CI machine (most of it importing SGLang in three
processes), and it was most of the suite's time; tests that only send requests need not pay it
again. The rules that keep sharing honest:

- A test gets a server through the `servers` fixture: `servers.get(model, *flags, env=...)`. The
  same key gives the same server; keep flags in one order where several tests should share.
- A shared server must outlive every test. A test that kills its server on purpose (a scheduler
  stopped by a check, a startup refusal), or whose assertions need a fresh one, owns it
  (`start_server` or `SGLangServer` directly) and says why in a comment.
- What a test reads from the log it reads with `srv.log_since()` (the fixture marks the log when
  it hands the server out), so an earlier test's lines cannot satisfy its checks; negative checks
  may read the whole log.
- A shared server's radix cache holds earlier tests' prefixes: a test that counts cached tokens
  flushes first.
- Servers are forked from a process that imported SGLang once (tools/zygote.py, started by
  tests/conftest.py), except the README's main configuration (DSpark adaptive on the trained
  model, shared by test_trained_tiny.py, test_bench_serve.py and test_prefix_cache_serving.py):
  it starts as a user's `python -m sglang.launch_server` does, with spawned scheduler and
  detokenizer, so that path stays tested. A test that owns its server may pass `zygote=False`.
- At most `SGLANG_DSV4_TEST_SERVERS` (default 1) pooled servers run at once per test process:
  the run order keeps the users of one server next to each other (SCHEDULE in
  tests/e2e/conftest.py), and an idle server is not free (a DP controller polls a core), so the
  previous one is stopped (without waiting for SGLang's shutdown) when another is needed, and all
  are stopped when the next test is not in the same group.
"""

from __future__ import annotations

from collections import OrderedDict

from sglang_dsv4_ascend import settings
from sglang_dsv4_ascend.tools.server import SGLangServer


def _key(model, args, env) -> tuple:
    return str(model), tuple(str(a) for a in args), tuple(sorted((env or {}).items()))


def _readme_config() -> tuple:
    from sglang_dsv4_ascend.bench import headline

    path, env, flags = headline.METHODS["dspark_adaptive"]
    return _key(path, (*headline.POOL, *flags), env)


class SharedServerDied(RuntimeError):
    pass


class ServerPool:
    def __init__(self, capacity: int | None = None):
        self.capacity = capacity or settings.TEST_SERVERS.get()
        self._alive: OrderedDict = OrderedDict()
        self._stopped: list = []
        self.hits = 0

    def get(self, model, *args, env: dict | None = None, startup_timeout: float = 300) -> SGLangServer:
        key = _key(model, args, env)
        srv = self._alive.pop(key, None)
        if srv is not None:
            if not srv.alive:
                # a shared server must never die: a test that kills one should have owned it
                raise SharedServerDied(f"the shared server {key} died during an earlier test\n{srv.log_tail(60)}")
            self._alive[key] = srv
            self.hits += 1
            return srv
        while len(self._alive) >= self.capacity:
            _, old = self._alive.popitem(last=False)
            self._stop(old)
        zygote = False if key == _readme_config() else None
        srv = SGLangServer(model, *args, env=env, startup_timeout=startup_timeout, zygote=zygote).start()
        self._alive[key] = srv
        return srv

    def _stop(self, srv) -> None:
        srv.stop(wait=False)
        self._stopped.append(srv)

    def release(self) -> None:
        """Stop every pooled server (no wait): the tests that share them are done."""
        while self._alive:
            self._stop(self._alive.popitem(last=False)[1])

    def close(self) -> None:
        self.release()
        for srv in self._stopped:
            srv.join()


class PoolView:
    """What one test sees of the pool: `get` marks each server's log for this test, and the
    servers it used are known so their logs are printed when the test fails."""

    def __init__(self, pool: ServerPool):
        self.pool = pool
        self.used: list = []

    def get(self, model, *args, env: dict | None = None, startup_timeout: float = 300) -> SGLangServer:
        srv = self.pool.get(model, *args, env=env, startup_timeout=startup_timeout)
        srv.mark()
        if srv not in self.used:
            self.used.append(srv)
        return srv
