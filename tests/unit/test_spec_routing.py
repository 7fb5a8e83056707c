"""Which worker SGLang gets for a speculative algorithm: ours for EAGLE / NEXTN / DSPARK on DeepSeek-V4 on
any platform (the CPU platform's OOT seam, or the hook for SGLang's builtin NPU platform, which is
never asked), SGLang's own for everything else."""

from types import SimpleNamespace

import pytest

from sglang_dsv4_ascend import checkpoint


@pytest.fixture
def worker(monkeypatch):
    from sglang_dsv4_ascend.speculative import worker as w

    return w


def test_builtin_platform_gets_our_worker_for_eagle_on_dsv4(worker, monkeypatch):
    from sglang_dsv4_ascend.integration.hooks.nextn_worker_on_builtin_platforms import platform_worker_cls

    monkeypatch.setattr(checkpoint, "serves_dsv4", lambda: True)
    for name in ("EAGLE", "NEXTN", "DSPARK"):
        assert platform_worker_cls(lambda self: None, SimpleNamespace(name=name)) is worker.DSV4SpecWorker
    assert platform_worker_cls(lambda self: None, SimpleNamespace(name="NGRAM")) is None
    platform_own = object()  # an OOT platform's answer is kept
    assert platform_worker_cls(lambda self: platform_own, SimpleNamespace(name="EAGLE")) is platform_own


def test_other_models_keep_sglang_workers(worker, monkeypatch):
    from sglang_dsv4_ascend.integration.hooks.nextn_worker_on_builtin_platforms import platform_worker_cls

    monkeypatch.setattr(checkpoint, "serves_dsv4", lambda: False)
    assert platform_worker_cls(lambda self: None, SimpleNamespace(name="EAGLE")) is None
    assert worker.worker_cls_for("EAGLE") is None
