"""A launcher that has imported SGLang once and forks a server per request: for the test suite
and other runs that start many servers on the CPU platform.

Why: a server start on the 2-core CI machine took 32-34 s, and about 29 s of it was Python
importing SGLang three times (`python -m sglang.launch_server`, then its scheduler and detokenizer,
which SGLang starts with `spawn`); the model's own work was about 4 s. Here the import is paid once
per test run. Each request forks a child that runs `sglang.launch_server` as `python -m` would
(its own session, log file, environment, working directory and argv) and whose scheduler and
detokenizer are forked from it instead of spawned: they inherit the imported modules. Everything
after the imports is SGLang's and the plugin's own code: the plugin is registered by SGLang's
`load_plugins()` in the child, as in any server.

What differs from a spawned server, said plainly:
- Fork instead of spawn: SGLang forces spawn for CUDA (device state does not survive a fork); on
  the CPU platform nothing device-side exists before the fork. A spawn-only problem (state not
  re-created in a fresh interpreter) would not show here, so the suite keeps servers started the
  plain way too (`SGLangServer(..., zygote=False)`).
- The platform is resolved when SGLang is imported, so an environment that selects it
  (IMPORT_TIME_ENV) cannot be honoured: such a server is started the plain way.

Only torch's import happens here, never a torch op: an OpenMP pool created before a fork is not
usable in the child.

Protocol: one JSON line per connection on a unix socket, {"argv", "env", "cwd", "log"} -> {"pid"};
the child's exit code is written to `<log>.rc` when it exits.

    python -m sglang_dsv4_ascend.tools.zygote SOCKET_PATH
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time

from .. import settings

# Read while SGLang is imported (platform selection): a server that sets one is started plainly.
IMPORT_TIME_ENV = (settings.PLATFORM.name, "SGLANG_USE_CPU_ENGINE", "SGLANG_PLATFORM")

ENV = settings.ZYGOTE.name  # the socket path; SGLangServer launches through it when set


def _preload() -> None:
    import sglang.launch_server
    import sglang.srt.entrypoints.http_server  # most of the ~11 s
    import sglang.srt.managers.detokenizer_manager
    import sglang.srt.managers.scheduler
    import sglang.srt.server_args  # noqa: F401


def _run_child(req: dict) -> None:
    """In the forked child: become `python -m sglang.launch_server ARGV` and never return."""
    code = 1
    try:
        os.setsid()
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        fd = os.open(req["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        nul = os.open(os.devnull, os.O_RDONLY)
        os.dup2(nul, 0)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import multiprocessing as mp

        # SGLang sets spawn unconditionally (engine._set_envs_and_config); the imports this process
        # holds are the point, so its scheduler and detokenizer are forked.
        mp.set_start_method("fork", force=True)
        mp.set_start_method = lambda method=None, force=False: None
        import runpy

        sys.argv = ["sglang.launch_server", *req["argv"]]
        runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        try:
            import atexit

            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(path: str) -> None:
    parent = os.getppid()  # before the imports: whoever started it may be gone by their end
    with open(path + ".pid", "w") as f:  # launch() waits only while this process lives
        f.write(str(os.getpid()))
    _preload()
    children: dict = {}  # pid -> rc path

    def reap(*_):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rc = children.pop(pid, None)
            if rc:
                with open(rc + ".tmp", "w") as f:
                    f.write(str(os.waitstatus_to_exitcode(status)))
                os.replace(rc + ".tmp", rc)

    signal.signal(signal.SIGCHLD, reap)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    tmp = path + ".bind"
    if os.path.exists(tmp):
        os.unlink(tmp)
    srv.bind(tmp)
    srv.listen(16)
    os.rename(tmp, path)  # the socket appears only when the imports are done
    print(f"[zygote] ready in {time.monotonic() - T0:.1f} s at {path}", flush=True)
    srv.settimeout(1.0)
    try:
        while True:
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                if os.getppid() != parent:  # whoever started it is gone (a killed test run)
                    return
                continue
            conn.settimeout(None)
            with conn:
                req = json.loads(conn.makefile("r").readline())
                sys.stdout.flush()
                sys.stderr.flush()
                signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGCHLD])
                pid = os.fork()
                if pid == 0:
                    srv.close()
                    conn.close()
                    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
                    _run_child(req)
                children[pid] = req["log"] + ".rc"
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGCHLD])
                conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
    finally:
        if os.path.exists(path):
            os.unlink(path)


def launch(path: str, argv: list, env: dict, log: str, timeout: float = 180.0) -> int:
    """Ask the zygote at `path` for a server; returns its pid. Waits for the zygote to finish its
    imports (the socket appears then) up to `timeout`; raises OSError if it cannot be reached."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline or not _alive(path + ".pid"):
            raise OSError(f"no zygote at {path} (waited {timeout:.0f} s at most)")
        time.sleep(0.1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.sendall((json.dumps({"argv": argv, "env": env, "cwd": os.getcwd(), "log": log}) + "\n").encode())
        return int(json.loads(s.makefile("r").readline())["pid"])


def _alive(pid_path: str) -> bool:
    try:
        with open(pid_path) as f:
            os.kill(int(f.read()), 0)
        return True
    except (OSError, ValueError):
        return False


def start(path: str, log: str):
    """Start a zygote in the background (the caller sets ENV to `path` for its servers)."""
    import subprocess

    for p in (path, path + ".pid"):
        if os.path.exists(p):
            os.unlink(p)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sglang_dsv4_ascend.tools.zygote", path],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    deadline = time.monotonic() + 30
    while not os.path.exists(path + ".pid") and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return proc


class ForkedProcess:
    """The part of subprocess.Popen that SGLangServer uses, for a server the zygote forked (not
    this process's child: its exit code comes from the file the zygote writes)."""

    def __init__(self, pid: int, rc_path: str):
        self.pid, self.rc_path, self.returncode = pid, rc_path, None

    def poll(self):
        if self.returncode is None:
            if not os.path.exists(self.rc_path):
                try:
                    os.kill(self.pid, 0)
                    return None
                except ProcessLookupError:  # gone: reaped by the zygote (file on its way) or by init
                    time.sleep(0.2)
                    if not os.path.exists(self.rc_path):
                        self.returncode = -1
                        return self.returncode
            with open(self.rc_path) as f:
                self.returncode = int(f.read())
        return self.returncode

    def wait(self, timeout: float | None = None):
        import subprocess

        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("zygote child", timeout)
            time.sleep(0.05)
        return self.returncode


T0 = time.monotonic()

if __name__ == "__main__":
    serve(sys.argv[1])
