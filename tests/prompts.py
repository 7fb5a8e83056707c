"""Prompts for tests: the package's own prompt sets (sglang_dsv4_ascend/data/prompts)."""

from sglang_dsv4_ascend.data import load_prompts, prompt_path, prompts_dir  # noqa: F401
