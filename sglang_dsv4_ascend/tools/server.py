"""Start a real SGLang server (subprocess) with the plugin installed, and talk to it.

Shared by the e2e tests, the demo (examples/serve_tiny.py) and the benchmarks.

Used as a context manager by the e2e fixtures: picks a free port on 127.0.0.1, waits for /health
with a timeout, dumps the server log on failure, and always tears the whole process group down.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request

from .. import settings

HOST = "127.0.0.1"

# Lines that mean a server process died even though the main process may linger.
FATAL_MARKERS = ("Scheduler hit an exception", "Received sigquit from a child process")


def free_port() -> int:
    """A free port for the server's HTTP listener, below the kernel's ephemeral range: a port the
    kernel hands out (bind to 0) is free now, but uvicorn binds it only after the model has loaded,
    and by then the kernel may have handed the same port to one of the server's own sockets (gloo
    listeners of a multi-rank server): "address already in use". SGLang draws its NCCL / gloo
    store port from 22000-29999 and internal ports up to --port + 1000, so this stays below both."""
    for port in random.SystemRandom().sample(range(12000, 21000), 64):  # unaffected by random.seed
        try:
            with socket.socket() as s:
                s.bind(("0.0.0.0", port))
            return port
        except OSError:
            continue
    with socket.socket() as s:  # the band is full: any free port
        s.bind((HOST, 0))
        return s.getsockname()[1]


class ServerFailed(RuntimeError):
    pass


class SGLangServer:
    def __init__(
        self,
        model_path: str,
        *extra_args: str,
        env: dict | None = None,
        startup_timeout: float = 240.0,
        zygote: bool | None = None,
    ):
        """zygote: launch through the pre-imported launcher named by $SGLANG_DSV4_ZYGOTE
        (tools/zygote.py) -- None: when one is set and `env` does not select the platform;
        False: always `python -m sglang.launch_server` in a fresh interpreter."""
        self.model_path = model_path
        self.zygote = zygote
        self.extra_args = list(extra_args)
        self.env = env or {}
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.proc = None
        self.log_path = None
        self._reaper = None
        self.launched_by = "python -m sglang.launch_server"
        self.log_mark = 0  # log_since() reads from here; a shared server's user moves it (mark())

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> "SGLangServer":
        fd, self.log_path = tempfile.mkstemp(prefix="sglang-server-", suffix=".log")
        log = os.fdopen(fd, "w")
        cmd = [
            sys.executable,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            HOST,
            "--port",
            str(self.port),
            "--dtype",
            "float32",
            "--max-total-tokens",
            "8192",
            "--skip-server-warmup",
            *self.extra_args,
        ]
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self.proc = self._forked(cmd[3:], env) if self._use_zygote() else None
        if self.proc is None:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise ServerFailed(f"server exited with {self.proc.returncode}\n{self.log_tail()}")
            if any(m in self.log_text() for m in FATAL_MARKERS):
                self.stop()
                raise ServerFailed(f"a server process failed\n{self.log_tail()}")
            try:
                if self.get("/health", timeout=2)[0] == 200:
                    return self
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        self.stop()
        raise ServerFailed(f"server not healthy after {self.startup_timeout}s\n{self.log_tail()}")

    def _use_zygote(self) -> bool:
        from . import zygote

        if self.zygote is False or not settings.ZYGOTE.is_set():
            return False
        return not any(k in self.env for k in zygote.IMPORT_TIME_ENV)

    def _forked(self, argv: list, env: dict):
        from . import zygote

        try:
            pid = zygote.launch(settings.ZYGOTE.get(), argv, env, self.log_path)
        except OSError as e:  # no zygote after all: start the plain way
            print(f"[server] zygote unavailable ({e}); starting a fresh interpreter", file=sys.stderr)
            return None
        self.launched_by = "zygote"
        return zygote.ForkedProcess(pid, self.log_path + ".rc")

    def stop(self, wait: bool = True) -> None:
        """SIGTERM the whole process group, SIGKILL it after 20 s. wait=False returns at once and
        leaves the wait to a thread (join() waits for it): a test suite need not spend SGLang's
        seconds of shutdown per server before it starts the next one."""
        if not self._signal_group(signal.SIGTERM):
            return
        if wait:
            self._reap()
        elif self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, daemon=True)
            self._reaper.start()

    def kill(self) -> None:
        """SIGKILL the whole process group now, as a crash or an OOM kill ends a server: no
        shutdown path runs (its peers see it vanish mid-whatever)."""
        if self._signal_group(signal.SIGKILL):
            self.proc.wait(timeout=10)

    def _signal_group(self, sig) -> bool:
        """Send `sig` to the server's process group; False when there is none left to signal."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            return False
        return True

    def _reap(self) -> None:
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._signal_group(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def join(self) -> None:
        """Wait for a stop(wait=False) to finish."""
        if self._reaper is not None:
            self._reaper.join()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def mark(self) -> None:
        """Start log_since() here (a shared server handed to the next test)."""
        self.log_mark = os.path.getsize(self.log_path) if self.log_path and os.path.exists(self.log_path) else 0

    def log_since(self) -> str:
        """The log written since mark(): what this test's requests made the server print."""
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as f:
            f.seek(self.log_mark)
            return f.read().decode(errors="replace")

    def log_text(self) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 120) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return "(no log)"
        with open(self.log_path, errors="replace") as f:
            lines = f.readlines()
        return "---- server log (tail) ----\n" + "".join(lines[-n:])

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- client -----------------------------------------------------------------------------
    def get(self, path: str, timeout: float = 30):
        with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
            return r.status, r.read()

    def post(self, path: str, payload: dict, timeout: float = 300) -> dict:
        req = urllib.request.Request(
            self.url + path, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                body = r.read()
                return json.loads(body) if body.strip() else {}
        except urllib.error.HTTPError as e:
            raise AssertionError(f"POST {path} -> {e.code}: {e.read()[:2000]!r}\n{self.log_tail(40)}") from e

    def generate(self, input_ids, max_new_tokens: int, **sampling) -> dict:
        params = {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}
        return self.post("/generate", {"input_ids": input_ids, "sampling_params": params})

    def server_info(self) -> dict:
        return json.loads(self.get("/get_server_info")[1])

    def used_tokens(self) -> int:
        """KV tokens held by requests, summed over the DP ranks (/v1/loads; SGLang counts radix-cached
        tokens as evictable, not used)."""
        return sum(load["num_used_tokens"] for load in json.loads(self.get("/v1/loads")[1])["loads"])


def process_tree(pid: int) -> list:
    """pid and all its descendants (Linux /proc)."""
    children: dict = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo += children.get(p, [])
    return out


def cpu_seconds(pids) -> float:
    """User + system CPU time consumed so far by `pids` (exited ones count as 0)."""
    ticks = 0
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            pass
    return ticks / os.sysconf("SC_CLK_TCK")


def idle_cores(srv: "SGLangServer", seconds: float = 5.0) -> float:
    """Average cores the server's processes use over `seconds` (call it while nothing is sent)."""
    pids = process_tree(srv.proc.pid)
    c0, t0 = cpu_seconds(pids), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pids) - c0) / (time.monotonic() - t0)
