"""The SGLang versions we support, and the signature check for every hook we install.

Hooks reach into SGLang functions that no registry covers; those are private and change between
releases. A hook on a changed target would misbehave silently, so before installing anything we
check the SGLang version and each target's signature and refuse to start, naming the supported
range, on any mismatch, and install either every hook or none. Each hook is declared beside its
body in integration/hooks/<name>.py and written down in patches/README.md.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Callable

SUPPORTED_SGLANG = (">=0.5.23", "<0.5.24")
SUPPORTED_SGLANG_TEXT = "sglang>=0.5.23,<0.5.24"


class UnsupportedSGLang(RuntimeError):
    pass


def _parse(v: str) -> tuple:
    parts = []
    for p in v.split("+")[0].split("."):
        num = "".join(ch for ch in p if ch.isdigit())
        parts.append(int(num) if num else 0)
    return tuple(parts)


def installed_sglang_version() -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def version_supported(v: str | None) -> bool:
    if v is None:
        return False
    return _parse("0.5.23") <= _parse(v) < _parse("0.5.24")


def check_sglang_version() -> str:
    v = installed_sglang_version()
    if not version_supported(v):
        raise UnsupportedSGLang(
            f"installed sglang {v} is outside the supported range {SUPPORTED_SGLANG_TEXT}; "
            f"install a supported sglang (pip install 'sglang==0.5.23') or a sglang-dsv4-ascend "
            f"release that supports {v}"
        )
    return v


HOOK_KINDS = ("BEFORE", "AFTER", "AROUND", "REPLACE")  # SGLang's HookType members


@dataclass(frozen=True)
class Hook:
    """One HookRegistry hook: where it goes, the parameters its target must have, how it wraps
    the target (`kind`) and our function (`body`)."""

    name: str
    target: str  # "module:qualname" of the SGLang function
    params: tuple  # expected parameter names of the target, in order
    kind: str  # one of HOOK_KINDS
    body: Callable

    def __post_init__(self):
        if self.kind not in HOOK_KINDS:
            raise ValueError(f"hook {self.name}: kind {self.kind!r} is not one of {HOOK_KINDS}")

    def install(self) -> None:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        HookRegistry.register(self.target.replace(":", "."), self.body, getattr(HookType, self.kind))

    def resolve(self):
        mod_name, qual = self.target.split(":")
        obj = importlib.import_module(mod_name)
        for part in qual.split("."):
            obj = getattr(obj, part)
        return obj

    def check(self) -> None:
        try:
            target = self.resolve()
        except (ImportError, AttributeError) as e:
            raise UnsupportedSGLang(
                f"hook {self.name}: target {self.target} not found ({e}); supported: {SUPPORTED_SGLANG_TEXT}"
            ) from e
        check_parameters(f"hook {self.name}: target {self.target}", target, self.params)


def check_parameters(what: str, target, params: tuple) -> None:
    """Refuse to start unless `target` (an SGLang function we hook, or a method we override; None:
    missing) has exactly the parameters `params`; `what` names it in the message."""
    got = tuple(inspect.signature(target).parameters) if target is not None else None
    if got != params:
        raise UnsupportedSGLang(f"{what} has parameters {got}, expected {params}; supported: {SUPPORTED_SGLANG_TEXT}")


def install_hooks(hs: list[Hook]) -> list[str]:
    """Check every hook target first, then install them all (nothing half-installed)."""
    for h in hs:
        h.check()
    for h in hs:
        h.install()
    return [h.name for h in hs]
