"""Speculative decoding for DeepSeek-V4: draft trees, lossless accept rules (pure PyTorch, CPU)."""
