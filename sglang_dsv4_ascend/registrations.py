"""What `register()` installs: the components that exist, and the hooks they need.

Kept apart from plugin.py so that `doctor` and the tests can list them without running them.
Each installer imports SGLang lazily: importing this package must not import SGLang internals or
torch_npu.
"""

from __future__ import annotations

# (name, installer) pairs; filled as components land (model, attention backend, ...).
COMPONENTS: list = []

# compat.Hook entries; each one is documented in patches/README.md.
HOOKS: list = []
