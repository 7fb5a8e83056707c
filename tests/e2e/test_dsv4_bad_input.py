"""Bad input for DeepSeek-V4 stops the real server with an error that names it: a checkpoint with a
dropped tensor (the tensor and its shape), a speculative algorithm we do not serve yet (the flag).
SGLang only logs plugin errors, so these prove ours surface."""

import json
import os

import pytest
from safetensors.torch import load_file, save_file

from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint
from sglang_dsv4_ascend.tools.server import SGLangServer, ServerFailed

pytestmark = pytest.mark.e2e


def test_dropped_tensor_is_named_and_server_refuses(tmp_path):
    d = write_checkpoint(str(tmp_path / "ck"), "flash", "dspark")
    shard = "model-00001-of-00002.safetensors"
    tensors = load_file(os.path.join(d, shard))
    victim = "layers.2.attn.indexer.wq_b.weight"
    expected_shape = tuple(tensors.pop(victim).shape)
    save_file(tensors, os.path.join(d, shard), metadata={"format": "pt"})
    idx_path = os.path.join(d, "model.safetensors.index.json")
    idx = json.load(open(idx_path))
    del idx["weight_map"][victim]
    json.dump(idx, open(idx_path, "w"))

    srv = SGLangServer(d, startup_timeout=180)
    with pytest.raises(ServerFailed) as e:
        srv.start()
    log = str(e.value)
    assert victim in log
    assert str(list(expected_shape)) in log or str(expected_shape) in log, log[-3000:]


def test_speculative_flag_is_refused_by_name(tmp_path):
    d = write_checkpoint(str(tmp_path / "ck"), "flash", "dspark")
    srv = SGLangServer(d, "--speculative-algorithm", "NEXTN", startup_timeout=120)
    with pytest.raises(ServerFailed) as e:
        srv.start()
    assert "--speculative-algorithm NEXTN: speculative decoding for DeepSeek-V4 is not available" in str(e.value)
