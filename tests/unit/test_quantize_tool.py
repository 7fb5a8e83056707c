"""tools/quantize_w8a8.py output format (ModelSlim), determinism, and the loader's named errors on
damaged W8A8 checkpoints (missing scale, wrong dtype, description naming an absent layer, ...)."""

import filecmp
import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from sglang_dsv4_ascend.checkpoint import DESCRIPTION_FILE
from sglang_dsv4_ascend.quantization.w8a8 import (
    W8A8Error,
    is_modelslim_checkpoint,
    load_w8a8_model_from_dir,
    read_quant_description,
)
from sglang_dsv4_ascend.tools.quantize_w8a8 import format_summary, main, quantize_checkpoint

SHARD = "model-00001-of-00002.safetensors"


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    p = tmp_path_factory.mktemp("calib") / "calib.jsonl"
    p.write_text(
        "\n".join(
            json.dumps({"turns": [t, "second turn ignored"]})
            for t in (
                "Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning.",
                "def has_close_elements(numbers: List[float], threshold: float) -> bool:",
                "Compose an engaging travel blog post about a recent trip to Hawaii.",
                "The quick brown fox jumps over the lazy dog 0123456789",
            )
        )
        + "\n"
    )
    return str(p)


@pytest.fixture(scope="module")
def outputs(tiny_ckpt, tmp_path_factory, calib):
    src = tiny_ckpt("flash")
    res = {}
    for scheme in ("dynamic", "static"):
        out = str(tmp_path_factory.mktemp(f"q_{scheme}"))
        summary = quantize_checkpoint(
            src, out, scheme, calib=calib if scheme == "static" else None, num_calib=4, progress=False
        )
        res[scheme] = (out, summary)
    return src, res


def _tensors(path):
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as h:
                for k in h.keys():
                    out[k] = h.get_tensor(k)
    return out


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_output_format(outputs, scheme):
    src, res = outputs
    out, summary = res[scheme]
    assert is_modelslim_checkpoint(out) and not is_modelslim_checkpoint(src)
    desc = read_quant_description(out)
    assert desc["model_quant_type"] == ("W8A8" if scheme == "static" else "W8A8_DYNAMIC")
    entries = {k: v for k, v in desc.items() if k not in ("model_quant_type", "version")}
    tensors, original = _tensors(out), _tensors(src)
    assert set(entries) == set(tensors), "description and safetensors must list the same tensors"
    with open(os.path.join(out, "model.safetensors.index.json")) as f:
        index = json.load(f)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert filecmp.cmp(os.path.join(src, f), os.path.join(out, f), shallow=False)

    dense = "W8A8" if scheme == "static" else "W8A8_DYNAMIC"
    expect = {
        "layers.2.attn.wq_a.weight": dense,
        "layers.2.attn.wq_b.weight": dense,
        "layers.2.attn.wkv.weight": dense,
        "layers.2.attn.indexer.wq_b.weight": dense,
        "layers.2.ffn.shared_experts.w2.weight": dense,
        "layers.2.ffn.experts.7.w3.weight": "W8A8_DYNAMIC",
        "mtp.0.attn.wq_a.weight": "W8A8_DYNAMIC",
        "layers.2.attn.wo_a.weight": "FLOAT",
        "layers.2.attn.wo_b.weight": "FLOAT",
        "layers.2.attn.indexer.weights_proj.weight": "FLOAT",
        "layers.2.attn.compressor.wkv.weight": "FLOAT",
        "layers.2.attn.indexer.compressor.wgate.weight": "FLOAT",
        "layers.2.ffn.gate.weight": "FLOAT",
        "layers.4.ffn.gate.bias": "FLOAT",
        "layers.0.ffn.gate.tid2eid": "FLOAT",
        "embed.weight": "FLOAT",
        "head.weight": "FLOAT",
        "hc_head_fn": "FLOAT",
        "layers.2.attn.attn_sink": "FLOAT",
    }
    for name, typ in expect.items():
        assert desc[name] == typ, name

    for name, typ in entries.items():
        if typ == "FLOAT":
            assert torch.equal(tensors[name], original[name]) and tensors[name].dtype == original[name].dtype
        elif name.endswith(".weight"):
            p = name[:-7]
            wq, s, o = tensors[name], tensors[p + ".weight_scale"], tensors[p + ".weight_offset"]
            w = original[name].float()
            N, K = w.shape
            assert wq.dtype == torch.int8 and wq.shape == (N, K)
            assert s.dtype == torch.float32 and s.shape == (N, 1) and o.shape == (N, 1) and torch.all(o == 0)
            assert torch.all(wq.abs().amax(1) == 127), "per-channel symmetric: each row reaches 127"
            # round-to-nearest: |Wq s - W| <= s/2, up to the fp32 rounding of W / s and Wq s (~2^-17 s).
            assert torch.all((wq.float() * s - w).abs() <= s * (0.5 + 2.0**-14))
            if typ == "W8A8":
                xs, xo = tensors[p + ".input_scale"], tensors[p + ".input_offset"]
                qb, dq = tensors[p + ".quant_bias"], tensors[p + ".deq_scale"]
                assert xs.shape == (1,) and xo.shape == (1,) and xs.dtype == torch.float32
                assert float(xo) == round(float(xo)) and -128 <= float(xo) <= 127
                assert float(xs.bfloat16().float()) == float(xs), "input_scale is kept bf16-representable"
                # What the two tensors are for, checked by their effect rather than the tool's formula:
                # quant_bias cancels the activation offset exactly in the int32 accumulator, and
                # deq_scale turns that accumulator back into x.W (fp32 product of both scales).
                xq = torch.randint(-128, 128, (4, K), generator=torch.Generator().manual_seed(N))
                acc = xq @ wq.long().t()
                assert qb.dtype == torch.int32
                assert torch.equal(acc + qb.long(), (xq - int(xo)) @ wq.long().t())
                want = np.float32(float(xs)) * s[:, 0].numpy().astype(np.float32)
                assert dq.dtype == torch.float32 and np.array_equal(dq.numpy(), want)
            else:
                assert not any(f"{p}.{x}" in tensors for x in ("input_scale", "quant_bias", "deq_scale"))
    n_quant = sum(1 for k, v in entries.items() if v != "FLOAT" and k.endswith(".weight"))
    assert n_quant == len(summary["layers"]) > 0


def test_summary_table_and_calibration_stats(outputs):
    _, res = outputs
    _, summary = res["static"]
    row = summary["layers"]["layers.1.attn.wq_a"]
    assert 0 < row["weight_rel_err"] < 0.02 and 0 < row["act_rel_err"] < 0.05
    assert row["act_lo"] < 0 < row["act_hi"] and 0 <= row["clip_frac"] < 0.01 and row["act_count"] > 0
    table = format_summary(summary)
    assert "layers.1.attn.wq_a" in table and "clip %" in table and "layers.1.ffn.experts.*.w1" in table


def test_cli_prints_summary(tiny_ckpt, tmp_path, capsys):
    assert main([tiny_ckpt("flash"), str(tmp_path / "o"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "w_err mean" in out and "W8A8_DYNAMIC" in out and "quantized weights (dynamic)" in out


@pytest.mark.parametrize("scheme", ["dynamic", "static"])
def test_deterministic(outputs, tiny_ckpt, tmp_path, calib, scheme):
    _, res = outputs
    out, _ = res[scheme]
    again = str(tmp_path / "again")
    quantize_checkpoint(
        tiny_ckpt("flash"), again, scheme, calib=calib if scheme == "static" else None, num_calib=4, progress=False
    )
    assert sorted(os.listdir(out)) == sorted(os.listdir(again))
    for f in os.listdir(out):
        assert filecmp.cmp(os.path.join(out, f), os.path.join(again, f), shallow=False), f


def test_tool_refuses_bad_inputs(outputs, tiny_ckpt, tmp_path, calib):
    _, res = outputs
    with pytest.raises(ValueError, match="needs calibration prompts"):
        quantize_checkpoint(tiny_ckpt("flash"), str(tmp_path / "a"), "static", progress=False)
    with pytest.raises(ValueError, match="only used by --scheme static"):
        quantize_checkpoint(tiny_ckpt("flash"), str(tmp_path / "b"), "dynamic", calib=calib, progress=False)
    with pytest.raises(ValueError, match="already quantized|not a float matrix"):
        quantize_checkpoint(res["dynamic"][0], str(tmp_path / "c"), "dynamic", progress=False)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "no turns"}\n')
    with pytest.raises(ValueError, match="turns"):
        quantize_checkpoint(tiny_ckpt("flash"), str(tmp_path / "d"), "static", calib=str(bad), progress=False)


# ------------------------------------------------------------------------------------------------
# damaged checkpoints -> errors that name the tensor / layer


def _damaged(src, dst, edit_tensors=None, edit_desc=None):
    shutil.copytree(src, dst)
    if edit_tensors:
        path = os.path.join(dst, SHARD)
        t = load_file(path)
        edit_tensors(t)
        save_file(t, path, metadata={"format": "pt"})
    if edit_desc:
        path = os.path.join(dst, DESCRIPTION_FILE)
        with open(path) as f:
            d = json.load(f)
        edit_desc(d)
        with open(path, "w") as f:
            json.dump(d, f)
    return dst


def test_error_missing_scale(outputs, tmp_path):
    path = _damaged(
        outputs[1]["dynamic"][0], tmp_path / "c", edit_tensors=lambda t: t.pop("layers.1.attn.wq_a.weight_scale")
    )
    with pytest.raises(W8A8Error, match=r"missing tensor.*'layers\.1\.attn\.wq_a\.weight_scale'.*W8A8_DYNAMIC"):
        load_w8a8_model_from_dir(str(path))


def test_error_missing_expert_scale(outputs, tmp_path):
    path = _damaged(
        outputs[1]["dynamic"][0], tmp_path / "c", edit_tensors=lambda t: t.pop("layers.3.ffn.experts.6.w2.weight_scale")
    )
    with pytest.raises(W8A8Error, match=r"missing tensor.*'layers\.3\.ffn\.experts\.6\.w2\.weight_scale'"):
        load_w8a8_model_from_dir(str(path))


def test_error_missing_static_deq_scale(outputs, tmp_path):
    path = _damaged(
        outputs[1]["static"][0], tmp_path / "c", edit_tensors=lambda t: t.pop("layers.0.attn.wkv.deq_scale")
    )
    with pytest.raises(W8A8Error, match=r"'layers\.0\.attn\.wkv\.deq_scale' \(W8A8 layer"):
        load_w8a8_model_from_dir(str(path))


def test_error_float_weight_declared_int8(outputs, tmp_path):
    def edit(t):
        t["layers.2.attn.wkv.weight"] = t["layers.2.attn.wkv.weight"].to(torch.bfloat16)

    path = _damaged(outputs[1]["dynamic"][0], tmp_path / "c", edit_tensors=edit)
    with pytest.raises(W8A8Error, match=r"'layers\.2\.attn\.wkv\.weight' is declared W8A8_DYNAMIC.*bfloat16.*int8"):
        load_w8a8_model_from_dir(str(path))


def test_error_float_expert_weight_declared_int8(outputs, tmp_path):
    def edit(t):
        t["layers.0.ffn.experts.1.w1.weight"] = t["layers.0.ffn.experts.1.w1.weight"].float()

    path = _damaged(outputs[1]["dynamic"][0], tmp_path / "c", edit_tensors=edit)
    with pytest.raises(W8A8Error, match=r"'layers\.0\.ffn\.experts\.1\.w1\.weight' is declared W8A8_DYNAMIC"):
        load_w8a8_model_from_dir(str(path))


def test_error_int8_weight_declared_float(outputs, tmp_path):
    def edit(d):
        for s in ("weight", "weight_scale", "weight_offset"):
            d[f"layers.1.attn.wq_b.{s}"] = "FLOAT"

    path = _damaged(outputs[1]["dynamic"][0], tmp_path / "c", edit_desc=edit)
    with pytest.raises(W8A8Error, match=r"'layers\.1\.attn\.wq_b\.weight.*"):
        load_w8a8_model_from_dir(str(path))


def test_error_description_names_absent_layer(outputs, tmp_path):
    path = _damaged(
        outputs[1]["dynamic"][0],
        tmp_path / "c",
        edit_desc=lambda d: d.update({"layers.9.attn.wq_a.weight": "W8A8_DYNAMIC"}),
    )
    with pytest.raises(W8A8Error, match=r"names 'layers\.9\.attn\.wq_a\.weight'.*no layer 'layers\.9\.attn\.wq_a'"):
        load_w8a8_model_from_dir(str(path))
    path = _damaged(
        outputs[1]["dynamic"][0], tmp_path / "d", edit_desc=lambda d: d.update({"layers.0.attn.wq_c.weight": "FLOAT"})
    )
    with pytest.raises(W8A8Error, match=r"names tensor 'layers\.0\.attn\.wq_c\.weight' \(FLOAT\)"):
        load_w8a8_model_from_dir(str(path))
    path = _damaged(
        outputs[1]["dynamic"][0],
        tmp_path / "e",
        edit_desc=lambda d: d.update({"layers.0.ffn.experts.99.w1.weight": "W8A8_DYNAMIC"}),
    )
    with pytest.raises(W8A8Error, match=r"layers\.0\.ffn\.experts\.99\.w1"):
        load_w8a8_model_from_dir(str(path))


def test_error_unsupported_quantized_layers(outputs, tmp_path):
    src = outputs[1]["dynamic"][0]
    # wo_a is read through .weight by the grouped output projection: cannot be W8A8 here.
    path = _damaged(src, tmp_path / "c", edit_desc=lambda d: d.update({"layers.0.attn.wo_a.weight": "W8A8_DYNAMIC"}))
    with pytest.raises(W8A8Error, match=r"'layers\.0\.attn\.wo_a\.weight' as W8A8_DYNAMIC.*reads"):
        load_w8a8_model_from_dir(str(path))
    # A layer's extra tensor typed unlike its weight.
    path = _damaged(src, tmp_path / "g", edit_desc=lambda d: d.update({"layers.0.ffn.experts.3.w2.weight": "FLOAT"}))
    with pytest.raises(W8A8Error, match=r"'layers\.0\.ffn\.experts\.3\.w2\.weight_offset' is 'W8A8_DYNAMIC' but"):
        load_w8a8_model_from_dir(str(path))
    # Some routed experts quantized, some not.
    path = _damaged(
        src,
        tmp_path / "d",
        edit_desc=lambda d: d.update(
            {f"layers.0.ffn.experts.3.w2.{s}": "FLOAT" for s in ("weight", "weight_scale", "weight_offset")}
        ),
    )
    with pytest.raises(W8A8Error, match=r"some routed experts of 'layers\.0\.ffn'.*experts\.3\.w2"):
        load_w8a8_model_from_dir(str(path))

    # Static routed experts.
    def static_experts(d):
        for k in list(d):
            if k.startswith("layers.0.ffn.experts."):
                d[k] = "W8A8"

    path = _damaged(src, tmp_path / "e", edit_desc=static_experts)
    with pytest.raises(W8A8Error, match=r"routed experts support W8A8_DYNAMIC only"):
        load_w8a8_model_from_dir(str(path))
    path = _damaged(src, tmp_path / "f", edit_desc=lambda d: d.update({"layers.0.attn.wq_a.weight": "W4A8_DYNAMIC"}))
    with pytest.raises(W8A8Error, match=r"'layers\.0\.attn\.wq_a\.weight' has type 'W4A8_DYNAMIC'"):
        load_w8a8_model_from_dir(str(path))


def test_error_nonzero_weight_offset_and_bad_shape(outputs, tmp_path):
    def edit(t):
        t["layers.0.attn.wq_a.weight_offset"] = torch.ones_like(t["layers.0.attn.wq_a.weight_offset"])

    path = _damaged(outputs[1]["dynamic"][0], tmp_path / "c", edit_tensors=edit)
    with pytest.raises(W8A8Error, match=r"'layers\.0\.attn\.wq_a\.weight_offset' is nonzero"):
        load_w8a8_model_from_dir(str(path))

    def edit2(t):
        t["layers.0.attn.wq_a.weight_scale"] = t["layers.0.attn.wq_a.weight_scale"][:5]

    path = _damaged(outputs[1]["dynamic"][0], tmp_path / "d", edit_tensors=edit2)
    with pytest.raises(W8A8Error, match=r"'layers\.0\.attn\.wq_a\.weight_scale' has shape \(5, 1\)"):
        load_w8a8_model_from_dir(str(path))


def test_error_scale_for_a_float_layer(outputs, tmp_path):
    def edit(t):
        t["layers.0.attn.wo_a.weight_scale"] = torch.ones(t["layers.0.attn.wo_a.weight"].shape[0], 1)

    path = _damaged(outputs[1]["dynamic"][0], tmp_path / "c", edit_tensors=edit)
    with pytest.raises(W8A8Error, match=r"unexpected tensor 'layers\.0\.attn\.wo_a\.weight_scale'.*'FLOAT'"):
        load_w8a8_model_from_dir(str(path))

    def edit2(t):
        t["layers.0.attn.wq_a.input_scale"] = torch.ones(1)

    path = _damaged(outputs[1]["dynamic"][0], tmp_path / "d", edit_tensors=edit2)
    with pytest.raises(W8A8Error, match=r"unexpected tensor 'layers\.0\.attn\.wq_a\.input_scale'.*W8A8_DYNAMIC"):
        load_w8a8_model_from_dir(str(path))


def test_wo_b_quantized_is_supported(tiny_ckpt, tmp_path):
    out = str(tmp_path / "wob")
    quantize_checkpoint(tiny_ckpt("flash"), out, "dynamic", quantize_wo_b=True, progress=False)
    assert read_quant_description(out)["layers.0.attn.wo_b.weight"] == "W8A8_DYNAMIC"
    from sglang_dsv4_ascend.quantization.w8a8 import W8A8Linear

    model = load_w8a8_model_from_dir(out)
    assert isinstance(model.layers[0].attn.wo_b, W8A8Linear)
