"""sglang-dsv4-ascend: DeepSeek-V4 on Ascend NPUs for stock SGLang.

Importing this package is cheap on purpose: SGLang imports it through entry points in every
process, and it must never pull in torch_npu or SGLang internals until SGLang calls in.
"""

__version__ = "0.1.0"
