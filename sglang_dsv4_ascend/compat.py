"""The SGLang versions we support, and the signature check for every hook we install.

Hooks reach into SGLang functions that no registry covers; those are private and change between
releases. A hook on a changed target would misbehave silently, so before installing anything we
check the SGLang version and each target's signature and refuse to start, naming the supported
range, on any mismatch. Every hook here is written down in patches/README.md.
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


@dataclass(frozen=True)
class Hook:
    """One hook: where it goes, the parameters its target must have, and how to install it."""

    name: str
    target: str  # "module:qualname"
    params: tuple  # expected parameter names of the target, in order
    install: Callable[[], None]

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
        got = tuple(inspect.signature(target).parameters)
        if got != self.params:
            raise UnsupportedSGLang(
                f"hook {self.name}: target {self.target} has parameters {got}, expected {self.params}; "
                f"supported: {SUPPORTED_SGLANG_TEXT}"
            )


def hooks() -> list[Hook]:
    from sglang_dsv4_ascend import registrations

    return list(registrations.HOOKS)


def install_hooks() -> list[str]:
    """Check every hook target first, then install them all (nothing half-installed)."""
    hs = hooks()
    for h in hs:
        h.check()
    for h in hs:
        h.install()
    return [h.name for h in hs]
