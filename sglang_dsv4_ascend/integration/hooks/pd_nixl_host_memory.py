"""Hook `pd_nixl_host_memory` (patches/README.md #18): NIXL on the CPU reference platform.

Why a hook: SGLang's NIXL connector names the memory of every pool "VRAM" (state, staging and
most transfer paths have it written in), and on a machine without a GPU that memory is host
memory, which NIXL's UCX backend refuses to register as VRAM ("VRAM memory is detected as host by
UCX"). And it builds its agent with NIXL's progress thread, which polls UCX without a pause
(`pthrDelay = 0` in NIXL's Python API): measured here, one core per idle server, both cores of
this machine with a prefill and a decode server up. There is no setting for either.

On our CPU platform, before the connector registers anything, its agent is rebuilt with the same
name and backend options without NIXL's progress thread, progressed instead by a thread that polls
it once a millisecond (some progress is needed: SGLang's decode side never calls its agent after
registering, and UCX over TCP needs the target to progress; without any, transfers stalled here),
and wrapped so that every "VRAM" it passes NIXL is "DRAM". Registration, descriptors and transfers
still go through NIXL and UCX. The rebuilt agent captures NIXL's transfer telemetry: the bytes each
finished transfer moved are summed and logged (`dsv4_ascend NIXL moved: ...`, at most once a
second, when they changed), so `bench pd` counts the bytes NIXL moved, not only the ones described.
On a device platform the agent is left alone.
"""

from __future__ import annotations

import logging
import re

from ..compat import Hook

logger = logging.getLogger("sglang_dsv4_ascend")

DEVICE_KIND, HOST_KIND = "VRAM", "DRAM"


class HostMemoryAgent:
    """A `nixl_agent` whose memory-kind arguments say DRAM where SGLang says VRAM, and which sums the
    bytes of the transfers it saw finish (NIXL's telemetry; SGLang polls every transfer it posts
    with `check_xfer_state` until DONE)."""

    def __init__(self, agent):
        self._agent = agent
        self._posted = {}  # id -> handle, posted and not yet seen finished (the ref keeps the id unique)
        self.moved_bytes = 0
        self.moved_transfers = 0

    def transfer(self, handle, *args, **kwargs):
        state = self._agent.transfer(handle, *args, **kwargs)
        if len(self._posted) >= MAX_POSTED:  # a transfer nobody polls to the end (a failed room's)
            self._posted.pop(next(iter(self._posted)))
        self._posted[id(handle)] = handle
        return self._settled(handle, state)

    def check_xfer_state(self, handle):
        return self._settled(handle, self._agent.check_xfer_state(handle))

    def _settled(self, handle, state):
        """Count a posted transfer's bytes the first time it is seen DONE (SGLang polls a finished
        one again); forget one that failed."""
        if state not in ("DONE", "ERR") or self._posted.pop(id(handle), None) is None:
            return state  # still running, or already settled
        if state == "DONE":
            try:
                self.moved_bytes += self._agent.get_xfer_telemetry(handle).totalBytes
                self.moved_transfers += 1
            except Exception:  # telemetry off (an agent we did not build): count nothing
                pass
        return state

    def __getattr__(self, name):
        attr = getattr(self._agent, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            return attr(*map(_host, args), **{k: _host(v) for k, v in kwargs.items()})

        return call


def _host(arg):
    return HOST_KIND if isinstance(arg, str) and arg == DEVICE_KIND else arg


PROGRESS_PERIOD_S = 0.001  # UCX progress on an idle agent: ~1k cheap calls a second instead of a spin
MOVED_LOG_PERIOD_S = 1.0
MOVED_LOG = "dsv4_ascend NIXL moved: %d transfers, %d bytes"  # read back by `moved`
MAX_POSTED = 4096


def moved(log: str) -> tuple:
    """(transfers, bytes) NIXL finished so far, from a server log's last MOVED_LOG line ((0, 0)
    before any). The count is logged within MOVED_LOG_PERIOD_S of its last change."""
    lines = re.findall(r"dsv4_ascend NIXL moved: (\d+) transfers, (\d+) bytes", log)
    return tuple(map(int, lines[-1])) if lines else (0, 0)


def paced_agent(name: str, backends: dict):
    """A NIXL agent `name` with these backends (name -> options) on host memory
    (`HostMemoryAgent`), progressed by a daemon thread that polls it once a millisecond instead of
    NIXL's progress thread."""
    import threading
    import time

    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    config = nixl_agent_config(
        enable_prog_thread=False,
        backends=[],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
        capture_telemetry=True,
    )
    agent = nixl_agent(name, config)
    for backend, options in backends.items():
        agent.create_backend(backend, options)

    wrapped = HostMemoryAgent(agent)

    def progress():
        logged, last = (0, 0), time.monotonic()
        while True:
            agent.get_new_notifs()  # progresses the agent's UCX workers (thread-safe: STRICT sync)
            time.sleep(PROGRESS_PERIOD_S)
            moved = (wrapped.moved_transfers, wrapped.moved_bytes)
            if moved != logged and time.monotonic() - last >= MOVED_LOG_PERIOD_S:
                logger.info(MOVED_LOG, *moved)
                logged, last = moved, time.monotonic()

    threading.Thread(target=progress, name="dsv4-nixl-progress", daemon=True).start()
    return wrapped


def host_memory_agent(self):
    from ...device import accelerator

    if accelerator() is not None or isinstance(self.agent, HostMemoryAgent):
        return
    name = self.agent.name
    backends = {b: dict(self.agent.backend_options[b]) for b in self.agent.backends}
    self.agent = None  # the old agent and its progress thread go before the new one starts
    self.agent = paced_agent(name, backends)
    logger.info("dsv4_ascend: NIXL agent on host memory (DRAM), progressed every %g ms", PROGRESS_PERIOD_S * 1e3)


HOOK = Hook(
    "pd_nixl_host_memory",
    "sglang.srt.disaggregation.nixl.conn:NixlKVManager.register_buffer_to_engine",
    ("self",),
    "BEFORE",
    host_memory_agent,
)
