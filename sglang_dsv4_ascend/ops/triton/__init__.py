"""Triton kernels for the DeepSeek-V4 hot ops, written in the subset that both upstream `triton` and
`triton-ascend` accept: plain masked loads/stores, elementwise math, `tl.dot`, reductions; no
`tl.inline_asm_elementwise`, no backend `libdevice` calls.

Importing this package is cheap: `triton` is imported by the submodules (`quant.py`), which
`ops/quant.py` loads only when the 'triton' kernel family is chosen. On CPU they run under the
Triton interpreter (`TRITON_INTERPRET=1`, read by triton at import time), which is how the tests
check them bit for bit against the plain-torch reference.
"""
