"""sglang-dsv4-ascend: DeepSeek-V4 on Ascend NPUs for stock SGLang.

Importing this package is cheap on purpose: SGLang imports it through entry points in every
process, and it must never pull in torch_npu or SGLang internals until SGLang calls in.
"""

import os as _os

__version__ = "0.1.0"

# The trained tiny DeepSeek-V4 that ships with the package (model card: MODEL_CARD.md beside it):
# the same target with its DSpark draft (the default) or with its NextN draft.
TINY_MODEL_DIR = _os.path.join(_os.path.dirname(__file__), "checkpoints", "tiny-dsv4")
TINY_MODEL_PATH = _os.path.join(TINY_MODEL_DIR, "dspark")
TINY_NEXTN_MODEL_PATH = _os.path.join(TINY_MODEL_DIR, "nextn")
TINY_STS_PATH = _os.path.join(TINY_MODEL_PATH, "dspark_sts.json")
