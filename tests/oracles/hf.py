"""Running HF transformers' DeepSeek-V4 as a peer oracle with our tie order."""

from __future__ import annotations

import collections

import torch

TopK = collections.namedtuple("TopK", "values indices")


def stable_topk(self, k, dim=-1, largest=True, sorted=True):
    """torch.Tensor.topk with ties broken by index (a stable sort), the order our indexer and
    router use: monkeypatched over HF's calls so equal scores pick the same entries in both."""
    v, i = torch.sort(self, dim=dim, descending=largest, stable=True)
    return TopK(v.narrow(dim, 0, k), i.narrow(dim, 0, k))
