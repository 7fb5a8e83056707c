"""W8A8 INT8 quantization for DeepSeek-V4 on Ascend.

`w8a8.py` (pure torch, no SGLang import): ModelSlim checkpoint description, `W8A8Linear`,
`W8A8Experts` / `W8A8MoE`, and `apply_modelslim_checkpoint(model, ckpt_dir)` for `DSV4Model`.
The numerics live in `sglang_dsv4_ascend.ops.quant` (reference / Triton / torch_npu families).
Importing this package imports nothing heavy.
"""
