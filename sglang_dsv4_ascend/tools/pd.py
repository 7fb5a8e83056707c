"""Prefill/decode disaggregation on one machine: a prefill server and a decode server (SGLang's
`--disaggregation-mode prefill|decode`, NIXL transfer engine over UCX) behind SGLang's router
(`python -m sglang_router.launch_router --pd-disaggregation --mini-lb`), launched as SGLang's own
PD test fixture (test/server_fixtures/disaggregation_fixture.py) launches them.

    python -m sglang_dsv4_ascend.tools.pd [--model PATH] [--prompt TEXT] [server flags ...]

starts the three, sends a prompt through the router, prints the completion with its speculative
statistics and the prefill side's transfer, and stops them. Server flags (e.g.
`--speculative-algorithm dspark --speculative-dspark-block-size 4`) go to both servers: both sides
must share the checkpoint, page and speculative settings (refused at bootstrap otherwise). Used by
tests/e2e/test_pd_serving.py and the PD benchmark.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from .server import HOST, ServerFailed, SGLangServer, free_port

BACKEND = ("--disaggregation-transfer-backend", "nixl")


def post_json(url: str, payload: dict, timeout: float = 300) -> dict:
    """POST a JSON body; an error status comes back as {"status": code, "error": body}."""
    req = urllib.request.Request(url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        return {"status": e.code, "error": e.read().decode(errors="replace")}


class PDServers:
    """A prefill server, a decode server and the router in front of them."""

    def __init__(self, model_path: str, *args: str, env: dict | None = None, startup_timeout: float = 300):
        self.bootstrap_port = free_port()
        self.prefill = SGLangServer(
            model_path,
            "--disaggregation-mode",
            "prefill",
            *BACKEND,
            "--disaggregation-bootstrap-port",
            str(self.bootstrap_port),
            *args,
            env=env,
            startup_timeout=startup_timeout,
        )
        self.decode = SGLangServer(
            model_path, "--disaggregation-mode", "decode", *BACKEND, *args, env=env, startup_timeout=startup_timeout
        )
        self.port = free_port()
        self.router = None
        self.router_log = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> "PDServers":
        from concurrent.futures import ThreadPoolExecutor

        try:
            with ThreadPoolExecutor(2) as ex:  # the two start at once: most of a start is imports
                for f in [ex.submit(self.prefill.start), ex.submit(self.decode.start)]:
                    f.result()
            self._start_router()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_router(self, timeout: float = 120) -> None:
        fd, self.router_log = tempfile.mkstemp(prefix="sglang-router-", suffix=".log")
        cmd = [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--pd-disaggregation",
            "--mini-lb",
            "--prefill",
            self.prefill.url,
            str(self.bootstrap_port),
            "--decode",
            self.decode.url,
            "--host",
            HOST,
            "--port",
            str(self.port),
        ]
        with os.fdopen(fd, "w") as log:
            self.router = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise ServerFailed(f"router exited with {self.router.returncode}\n{self.router_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            time.sleep(0.25)
        raise ServerFailed(f"router not healthy after {timeout}s\n{self.router_tail()}")

    def router_tail(self, n: int = 40) -> str:
        if not self.router_log or not os.path.exists(self.router_log):
            return "(no router log)"
        with open(self.router_log, errors="replace") as f:
            return "---- router log (tail) ----\n" + "".join(f.readlines()[-n:])

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.router.kill()
        for srv in (self.decode, self.prefill):
            srv.stop(wait=False)
        for srv in (self.decode, self.prefill):
            srv.join()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def post(self, path: str, payload: dict, timeout: float = 300) -> dict:
        """POST through the router (`post_json`)."""
        return post_json(self.url + path, payload, timeout)

    def generate(self, input_ids=None, max_new_tokens: int = 32, text: str | None = None, **sampling) -> dict:
        body = {"sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0, **sampling}}
        body.update({"text": text} if text is not None else {"input_ids": input_ids})
        return self.post("/generate", body)


def main(argv=None) -> int:
    import sglang_dsv4_ascend as pkg

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default=pkg.TINY_MODEL_PATH, help="checkpoint (default: the shipped tiny DeepSeek-V4)")
    ap.add_argument("--prompt", default="def fibonacci(n):", help="text sent through the router")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    args, server_flags = ap.parse_known_args(argv)
    print(f"[pd] starting a prefill server, a decode server and the router ({' '.join(server_flags) or 'no flags'})")
    t0 = time.monotonic()
    with PDServers(args.model, *server_flags) as pd:
        up = time.monotonic() - t0
        print(f"[pd] up in {up:.0f} s: prefill {pd.prefill.url}, decode {pd.decode.url}, router {pd.url}")
        out = pd.generate(text=args.prompt, max_new_tokens=args.max_new_tokens)
        if "error" in out:
            print(f"[pd] the request failed ({out['status']}): {out['error']}")
            return 1
        meta = out["meta_info"]
        print(f"[pd] prompt: {args.prompt!r}\n[pd] completion: {out['text']!r}")
        spec = {k: v for k, v in meta.items() if k.startswith("spec_")}
        print(f"[pd] {meta['completion_tokens']} tokens in {meta['e2e_latency']:.2f} s" + (f"; {spec}" if spec else ""))
        transferred = [ln for ln in pd.prefill.log_text().splitlines() if "NIXL" in ln and "agent" in ln]
        print("[pd] transfer engine: " + (transferred[-1].split("] ", 1)[-1] if transferred else "NIXL"))
        from ..integration.hooks.pd_nixl_host_memory import MOVED_LOG_PERIOD_S, moved

        time.sleep(MOVED_LOG_PERIOD_S + 0.5)  # the agent's count is logged within a period
        transfers, nbytes = moved(pd.prefill.log_text())
        if transfers:  # (counted on the CPU platform only)
            print(f"[pd] state moved for this request: {transfers} transfers, {nbytes} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
