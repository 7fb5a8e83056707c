"""The single `sglang.srt.platforms` entry point of this distribution.

SGLang allows one platform per process and, with SGLANG_PLATFORM set, drops the general plugins of
every distribution that offers a *different* platform entry point; two entry points here (cpu and
ascend) would switch off our own hooks whichever was chosen. So one `activate()` picks.

This module must stay import-light: many SGLang modules read `current_platform` at import time, so
`activate()` runs while SGLang itself is half imported. No sglang or torch_npu imports here.
"""

from __future__ import annotations

import os

from .. import device, settings

CPU_PLATFORM = "sglang_dsv4_ascend.platforms.cpu.CpuReferencePlatform"


def activate() -> str | None:
    # auto (default), cpu (forced, even on an accelerator host) or off (SGLang picks its own)
    mode = settings.PLATFORM.get()
    if mode == "off":
        return None
    if mode == "cpu":
        return CPU_PLATFORM
    # Never hijack a real accelerator install, nor SGLang's own CPU engine when asked for.
    if os.environ.get("SGLANG_USE_CPU_ENGINE", "0") == "1":
        return None
    # On an NPU host SGLang's own NPU platform serves (our Ascend platform, a subclass of it, is
    # not shipped yet) and our general plugin still registers.
    return None if device.accelerator() else CPU_PLATFORM
