"""Hook `spec_stats_every_completion_chunk` (patches/README.md #11): the OpenAI completions
stream gets what `spec_stats_every_chat_chunk` gives the chat stream, with the same body.
"""

from __future__ import annotations

from ..compat import Hook
from .spec_stats_every_chat_chunk import stream_with_stats

HOOK = Hook(
    "spec_stats_every_completion_chunk",
    "sglang.srt.entrypoints.openai.serving_completions:OpenAIServingCompletion._generate_completion_stream",
    ("self", "adapted_request", "request", "raw_request"),
    "AROUND",
    stream_with_stats,
)
