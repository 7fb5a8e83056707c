"""Benchmarks: `python -m sglang_dsv4_ascend.bench <name> ...`, each printing one JSON document with
its configuration and the ratios it measured side by side in one run."""
