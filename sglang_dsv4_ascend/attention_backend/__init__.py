"""The dsv4_ascend attention backend: per-request DeepSeek-V4 caches (cache.py), the SGLang pool
(pool.py) and the backend that builds per-forward segments (backend.py)."""
