"""The `dsv4_ascend` attention backend as SGLang sees it: the backend that turns each ForwardBatch
into segments and a plan (backend.py), the KV pool that holds our cache (pool.py), and the radix
cache whose hits resume from saved prefix states (radix.py). The cache itself, the plan and the
prefix states are plain torch, in kvcache/."""
