"""Bad input for DeepSeek-V4 stops the real server with an error that names it and says what to
fix: a broken checkpoint (dropped tensor, non-checkpoint dtype, wrong config, missing tokenizer
files), a quantization flag that does not fit the checkpoint, and settings we cannot serve
(page / chunk sizes, speculative settings the NextN worker cannot serve). SGLang only logs plugin
errors and some of these used to fail deep inside transformers or SGLang with messages that point
elsewhere, so each case starts a real `sglang.launch_server` and reads what it printed (the
unmodified checkpoint serves in test_dsv4_serving.py). The servers start in parallel."""

import json
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from safetensors.torch import load_file, save_file

from sglang_dsv4_ascend.tools.make_tiny_checkpoint import write_checkpoint
from sglang_dsv4_ascend.tools.server import ServerFailed, SGLangServer

pytestmark = pytest.mark.e2e

SHARD = "model-00001-of-00002.safetensors"


def _edit_tensors(d, fn):
    tensors = load_file(os.path.join(d, SHARD))
    fn(tensors)
    save_file(tensors, os.path.join(d, SHARD), metadata={"format": "pt"})


def _edit_config(d, **fields):
    path = os.path.join(d, "config.json")
    cfg = json.load(open(path))
    cfg.update(fields)
    json.dump(cfg, open(path, "w"))


def case_dropped_tensor(d):
    victim = "layers.2.attn.indexer.wq_b.weight"
    shape = []

    def drop(t):
        shape.append(tuple(t.pop(victim).shape))

    _edit_tensors(d, drop)
    idx_path = os.path.join(d, "model.safetensors.index.json")
    idx = json.load(open(idx_path))
    del idx["weight_map"][victim]
    json.dump(idx, open(idx_path, "w"))
    return [], [victim, str(shape[0])]


def case_float64_weight(d):
    _edit_tensors(d, lambda t: t.__setitem__("layers.0.attn.wq_a.weight", t["layers.0.attn.wq_a.weight"].double()))
    return [], [
        "layers.0.attn.wq_a.weight",
        "dtype torch.float64 is not a checkpoint dtype; expected bf16 / fp16 / fp32",
    ]


def case_compress_ratios_length(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    _edit_config(d, compress_ratios=cfg["compress_ratios"] + [0, 0])
    return [], ["compress_ratios=", "expected a list of 8 integers (num_hidden_layers=5 main-layer entries"]


def case_sliding_window_zero(d):
    _edit_config(d, sliding_window=0)
    return [], ["sliding_window=0 is invalid; expected a positive integer"]


def case_missing_tokenizer(d):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        os.remove(os.path.join(d, f))
    return [], [f"tokenizer: none of tokenizer.json / tokenizer.model in {d}", "--tokenizer-path"]


def case_w8a8_flag_on_float_checkpoint(d):
    return ["--quantization", "w8a8_ascend"], [
        "has no quant_model_description.json",
        "python -m sglang_dsv4_ascend.tools.quantize_w8a8",
    ]


def case_unsupported_quantization(d):
    return ["--quantization", "fp8"], ["--quantization fp8: not supported for DeepSeek-V4", "supported: w8a8_ascend"]


def case_page_size(d):
    return ["--page-size", "64"], ["--page-size 64: DeepSeek-V4 pages must be a multiple of 128"]


def case_chunked_prefill(d):
    return ["--chunked-prefill-size", "100"], ["--chunked-prefill-size 100: must be a multiple of the page size 128"]


def case_nextn_on_a_dspark_checkpoint(d):
    return ["--speculative-algorithm", "NEXTN"], [
        "--speculative-algorithm NEXTN:",
        "has a DSpark draft (mtp.*.main_proj), not a NextN block",
    ]


def case_dspark_on_a_nextn_checkpoint(d):
    write_checkpoint(d, "flash", "nextn")
    return ["--speculative-algorithm", "DSPARK"], [
        "--speculative-algorithm DSPARK:",
        "has a NextN block (mtp.0.e_proj), not a DSpark draft",
    ]


def case_tree_wider_than_its_draft_tokens(d):
    write_checkpoint(d, "flash", "nextn")  # a NextN checkpoint: refused by the worker's final check
    return [
        "--speculative-algorithm",
        "nextn",
        "--speculative-num-steps",
        "2",
        "--speculative-eagle-topk",
        "4",
        "--speculative-num-draft-tokens",
        "3",
    ], ["--speculative-eagle-topk 4: at most --speculative-num-draft-tokens - 1 = 2"]


def case_index_topk_freq_zero(d):
    return ["--json-model-override-args", '{"index_topk_freq": 0}'], [
        "--json-model-override-args: DSV4 config: index_topk_freq=0 is invalid; expected a positive integer"
    ]


CASES = [
    case_dropped_tensor,
    case_float64_weight,
    case_compress_ratios_length,
    case_sliding_window_zero,
    case_missing_tokenizer,
    case_w8a8_flag_on_float_checkpoint,
    case_unsupported_quantization,
    case_page_size,
    case_chunked_prefill,
    case_nextn_on_a_dspark_checkpoint,
    case_dspark_on_a_nextn_checkpoint,
    case_tree_wider_than_its_draft_tokens,
    case_index_topk_freq_zero,
]


def _attempt(case, root):
    d = write_checkpoint(str(root / case.__name__), "flash", "dspark")
    args, words = case(d)
    srv = SGLangServer(d, *args, startup_timeout=300)
    try:
        srv.start()
    except ServerFailed as e:
        return case.__name__, words, str(e) + srv.log_text()
    srv.stop()
    return case.__name__, words, None


def test_startup_errors_name_the_cause(tmp_path):
    with ThreadPoolExecutor(3) as ex:
        results = list(ex.map(lambda c: _attempt(c, tmp_path), CASES))
    for name, words, log in results:
        assert log is not None, f"{name}: the server started"
        missing = [w for w in words if w not in log]
        assert not missing, f"{name}: {missing} not in the server output:\n{log[-3000:]}"
