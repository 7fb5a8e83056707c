"""The `sglang.srt.plugins` entry point: one `register()` that SGLang calls in every process
(main, scheduler, detokenizer) before it builds anything.

It fills SGLang's registries (`integration/components.py`) and installs the hooks
(`integration/hooks/`), after checking the SGLang version and every hook target. SGLang only
*logs* exceptions raised by plugins and then carries on, which would leave a server running
half-patched. So a failure here is printed loudly and re-raised as SystemExit where it would
otherwise misbehave (an unsupported SGLang version with hooks to install).
"""

from __future__ import annotations

import logging
import sys

from .integration import compat, components, hooks

logger = logging.getLogger("sglang_dsv4_ascend")

_done = False


def register() -> None:
    global _done
    if _done:
        return
    _done = True
    try:
        compat.check_sglang_version()
        for _, install in components.COMPONENTS:
            install()
        installed = compat.install_hooks(hooks.HOOKS)
    except compat.UnsupportedSGLang as e:
        msg = f"[sglang-dsv4-ascend] refusing to start: {e}"
        print(msg, file=sys.stderr, flush=True)
        logger.error(msg)
        raise SystemExit(msg) from e
    logger.info(
        "sglang-dsv4-ascend registered: components=%s hooks=%s", [name for name, _ in components.COMPONENTS], installed
    )
