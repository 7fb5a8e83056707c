"""DeepSeek-V4's per-request state as plain tensors, with no SGLang import.

    cache.py          DSV4Cache: SWA rings, compressor rows, C4 / C128 / indexer entries per slot
    plan.py           ForwardPlan: one forward's geometry (every row index the layers read and write)
    prefix_state.py   states saved at page boundaries, from which a radix (prefix) hit resumes

The model (models/trunk.py) reads and writes it; the SGLang side (attention_backend/) wraps it in
SGLang's KV pool and builds one plan per forward.
"""
