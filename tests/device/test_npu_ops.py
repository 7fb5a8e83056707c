"""torch_npu implementations of the model's hot ops vs the reference. Skipped unless torch_npu is
installed (never on CPU machines); this project has not run it on an NPU yet."""

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.device,
              pytest.mark.skipif(importlib.util.find_spec("torch_npu") is None, reason="needs torch_npu (Ascend NPU)")]


@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_matches_reference(with_weight):
    from sglang_dsv4_ascend.ops import npu, reference

    x = torch.randn(37, 512, dtype=torch.bfloat16)
    w = (1 + 0.1 * torch.randn(512)).to(torch.bfloat16) if with_weight else None
    want = reference.rms_norm(x, w, 1e-6).float()
    got = npu.rms_norm(x.npu(), None if w is None else w.npu(), 1e-6).cpu().float()
    assert (got - want).abs().max() <= 2e-2 * want.abs().max()
