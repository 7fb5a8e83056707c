"""DeepSeek-V4 across ranks: each rank's coordinates (`layout`), how the checkpoint is split
over them (`sharding`) and the check that speculative decisions agree on every rank (`spec_sync`)."""

from .layout import Layout, layout_problems, log_layout

__all__ = ["Layout", "layout_problems", "log_layout"]
