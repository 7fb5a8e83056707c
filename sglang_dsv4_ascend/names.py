"""Names this plugin and SGLang agree on, each spelled once. A leaf: imports nothing.

Every module that matches a name against SGLang's (an architecture, a backend, a quantization
method, a speculative algorithm) or declares one to it imports it from here. The SGLang functions
we hook are named in their hook files (`integration/hooks/<hook name>.py`, one target each);
the environment settings are in `settings.py`.
"""

from __future__ import annotations

# The checkpoint architectures our model serves (config.json `architectures[0]`).
DSV4_ARCHS = ("DeepseekV4ForCausalLM",)
DSV4_ARCH = DSV4_ARCHS[0]

# Where SGLang finds our model classes (SGLANG_EXTERNAL_MODEL_PACKAGE: each module's EntryClass).
MODELS_PACKAGE = "sglang_dsv4_ascend.models"

# --attention-backend: our SGLang attention backend (attention_backend/backend.py).
BACKEND_NAME = "dsv4_ascend"
# --radix-cache-backend: our prefix (radix) cache (attention_backend/radix.py).
RADIX_BACKEND = "dsv4_ascend"
# --quantization: ModelSlim W8A8 checkpoints (quantization/w8a8_ascend.py).
QUANT_METHOD = "w8a8_ascend"

# DeepSeek-V4 KV pages, in tokens: every compression ratio (4, 128) divides it, so a compressed
# entry never straddles two pages. Pages must be a multiple of it (kvcache/cache.py aligns the
# entry store to it too).
PAGE_SIZE = 128

# --speculative-algorithm values our worker serves (speculative/worker.py). NEXTN is SGLang's
# alias of EAGLE for MTP heads; DSPARK is SGLang's name for block drafting with a DSpark draft.
NEXTN_ALGOS = ("EAGLE", "NEXTN")
DSPARK_ALGO = "DSPARK"
SPEC_ALGOS = NEXTN_ALGOS + (DSPARK_ALGO,)

# The CPU reference platform's KV pool cap when the user sets none (--max-total-tokens): uncapped,
# SGLang sizes the pool from "free device memory" = free RAM (measured: 15 GB for a tiny model),
# and a CPU server shares RAM with everything else.
CPU_MAX_TOTAL_TOKENS = 32768
# ... and its request slots for DeepSeek-V4 (--max-running-requests): SGLang's req_to_token keeps
# a context-wide row per slot (1M positions for DeepSeek-V4) and each slot carries fixed rings.
CPU_DSV4_MAX_RUNNING_REQUESTS = 16
