"""W8A8 drafts: the quantize tool writes a checkpoint's draft layers (DSpark `mtp.0..2`, NextN
`mtp.0`) as ModelSlim's V4 recipe does, and the loader builds them into the draft's own blocks
(`quantization.w8a8.DraftView`), so `--speculative-algorithm dspark|nextn --quantization
w8a8_ascend` serves them (tests/e2e/test_trained_tiny.py: lossless through real servers).

Oracles: which draft modules are int8 is read from the test's own copy of the recipe; one draft
linear's output is recomputed from the int8 tensors stored in the files (per-token symmetric int8
activations, exact int32 accumulation, both scales) without the package's quant ops."""

import glob
import json
import re

import pytest
import torch
from safetensors import safe_open

from sglang_dsv4_ascend.config import DSV4Config
from sglang_dsv4_ascend.models.dspark import CONFIDENCE_BIAS, ConfidenceHead, DSparkDraft
from sglang_dsv4_ascend.models.nextn import NextN
from sglang_dsv4_ascend.models.weights import iter_checkpoint
from sglang_dsv4_ascend.quantization.w8a8 import (
    DraftView,
    W8A8Error,
    W8A8Linear,
    W8A8MoE,
    apply_quant_description,
    draft_description,
    load_w8a8_weights,
    quantized_draft_layers,
    read_quant_description,
)
from sglang_dsv4_ascend.tools.quantize_w8a8 import quantize_checkpoint

# ModelSlim's V4 recipe for a draft block (dsv4_reference.md §4.2), written out independently
INT8 = re.compile(r"^mtp\.\d+\.(attn\.(wq_a|wq_b|wkv)|ffn\.shared_experts\.w[123]|main_proj)$")


@pytest.fixture(scope="module")
def quantized(tiny_checkpoint, tmp_path_factory):
    dirs = {}

    def get(draft, float_draft=False):
        if (draft, float_draft) not in dirs:
            out = str(tmp_path_factory.mktemp(f"w8a8_draft_{draft}"))
            quantize_checkpoint(tiny_checkpoint("flash", draft), out, progress=False, float_draft=float_draft)
            dirs[draft, float_draft] = out
        return dirs[draft, float_draft]

    return get


def _stored(path, prefix):
    out = {}
    for shard in glob.glob(f"{path}/*.safetensors"):
        with safe_open(shard, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys() if k.startswith(prefix)})
    return out


def _draft(path, kind, desc=None, drop=None, replace=None):
    """(the draft module, its DraftView) loaded from a W8A8 checkpoint as the server adapter does
    (without the tensor `drop`; `replace`: {name: tensor} read instead of the file's)."""
    with open(f"{path}/config.json") as f:
        cfg = DSV4Config.from_hf(json.load(f))
    desc = read_quant_description(path) if desc is None else desc
    items = [it for it in iter_checkpoint(path, skip=lambda n: not n.startswith("mtp.")) if it[0] != drop]
    items = [(it[0], (replace or {}).get(it[0], it[1]), *it[2:]) for it in items]
    if kind == "dspark":
        draft = DSparkDraft(cfg)
        if not any(it[0] == CONFIDENCE_BIAS for it in items):
            draft.mtp[-1].confidence_head = ConfidenceHead(cfg.hidden_size + cfg.dspark_markov_rank, bias=False)
        blocks = draft.mtp
    else:
        draft = NextN(cfg)
        blocks = [draft]
    view = DraftView(blocks, cfg, torch.float32)
    apply_quant_description(view, draft_description(desc))
    load_w8a8_weights(view, items, draft_description(desc), source=path)
    return draft, view


@pytest.mark.parametrize("kind", ["dspark", "nextn"])
def test_draft_layers_are_int8_where_the_recipe_says(quantized, kind):
    path = quantized(kind)
    desc = read_quant_description(path)
    _, view = _draft(path, kind)
    int8 = {n for n, m in view.named_modules() if isinstance(m, W8A8Linear)}
    floats = {n for n, m in view.named_modules() if isinstance(m, torch.nn.Linear) and not isinstance(m, W8A8Linear)}
    assert int8 and int8 == {n for n in int8 | floats if INT8.match(n)}
    assert all(not INT8.match(n) for n in floats)  # wo_a, wo_b, e_proj / h_proj, heads stay float
    moes = [n for n, m in view.named_modules() if isinstance(m, W8A8MoE)]
    assert moes == [f"mtp.{i}.ffn" for i in range(3 if kind == "dspark" else 1)]
    assert all(desc[f"{n}.experts.0.w1.weight"] == "W8A8_DYNAMIC" for n in moes)
    assert all(desc[f"{n}.weight"] == "W8A8_DYNAMIC" for n in int8)  # the draft is not calibrated


def test_a_draft_linear_computes_from_the_stored_int8_tensors(quantized):
    path = quantized("dspark")
    _, view = _draft(path, "dspark")
    name = "mtp.1.attn.wq_a"
    stored = _stored(path, name + ".")
    w, s_w = stored[name + ".weight"], stored[name + ".weight_scale"].float().flatten()
    assert w.dtype == torch.int8
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(0))
    s_x = x.abs().amax(dim=1) / 127
    xq = torch.round(x / s_x[:, None]).clamp(-128, 127)
    want = (xq.double() @ w.double().T) * s_x.double()[:, None] * s_w.double()[None, :]
    got = view.get_submodule(name)(x)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def _oracle_gap(view, path, name):
    """max |draft linear - the int64 oracle from the stored int8 weight and scale| on random rows."""
    stored = _stored(path, name + ".")
    w, s_w = stored[name + ".weight"], stored[name + ".weight_scale"].float().flatten()
    x = torch.randn(5, w.shape[1], generator=torch.Generator().manual_seed(1))
    s_x = x.abs().amax(dim=1) / 127
    xq = torch.round(x / s_x[:, None]).clamp(-128, 127)
    want = (xq.double() @ w.double().T) * s_x.double()[:, None] * s_w.double()[None, :]
    return (view.get_submodule(name)(x).double() - want).abs().max().item()


def test_a_draft_layer_given_the_targets_scale_is_caught(quantized):
    """The same-shaped scale of the target's wq_a loaded into a draft stage's wq_a loads (shapes
    agree) but computes away from the oracle of the draft's own stored tensors."""
    path, name = quantized("dspark"), "mtp.1.attn.wq_a"
    target_scale = _stored(path, "layers.2.attn.wq_a.weight_scale")["layers.2.attn.wq_a.weight_scale"]
    _, good = _draft(path, "dspark")
    _, bad = _draft(path, "dspark", replace={name + ".weight_scale": target_scale})
    assert _oracle_gap(good, path, name) < 1e-5 < _oracle_gap(bad, path, name)


def test_a_draft_tensor_without_its_description_entry_is_named(quantized):
    path = quantized("dspark")
    desc = {k: v for k, v in read_quant_description(path).items() if not k.startswith("mtp.1.attn.wq_a.")}
    with pytest.raises(W8A8Error, match=r"mtp\.1\.attn\.wq_a"):
        _draft(path, "dspark", desc)


def test_a_static_checkpoint_keeps_its_draft_dynamic(tiny_checkpoint, tmp_path):
    """--scheme static calibrates the target's dense layers (W8A8, static activation scales); the
    draft is not run during calibration, so its layers stay W8A8_DYNAMIC, and load and compute as
    such (the same int64 oracle)."""
    calib = tmp_path / "calib.jsonl"
    calib.write_text("\n".join(json.dumps({"turns": [f"calibration prompt {i} " * 8]}) for i in range(4)))
    out = str(tmp_path / "static")
    quantize_checkpoint(
        tiny_checkpoint("flash", "dspark"), out, "static", calib=str(calib), num_calib=4, progress=False
    )
    desc = read_quant_description(out)
    assert desc["layers.2.attn.wq_a.weight"] == "W8A8" and desc["mtp.1.attn.wq_a.weight"] == "W8A8_DYNAMIC"
    _, view = _draft(out, "dspark")
    assert _oracle_gap(view, out, "mtp.1.attn.wq_a") < 1e-5


def test_a_float_draft_beside_a_w8a8_target(quantized):
    path = quantized("dspark", float_draft=True)
    desc = read_quant_description(path)
    assert quantized_draft_layers(desc) == []
    assert any(v == "W8A8_DYNAMIC" for k, v in desc.items() if k.startswith("layers."))  # the target is int8
    assert all(t.is_floating_point() for k, t in _stored(path, "mtp.").items() if k.endswith("weight"))


def test_description_and_files_must_agree_on_the_draft(quantized):
    path = quantized("dspark")
    desc = read_quant_description(path)
    # an int8 draft tensor the description calls float
    bad = {**desc, "mtp.1.attn.wq_a.weight": "FLOAT"}
    bad = {k: v for k, v in bad.items() if not k.startswith("mtp.1.attn.wq_a.weight_")}
    with pytest.raises(W8A8Error, match=r"mtp\.1\.attn\.wq_a"):
        _draft(path, "dspark", bad)
    # a description naming a draft tensor the model lacks
    with pytest.raises(W8A8Error, match=r"mtp\.2\.attn\.wq_c"):
        _draft(path, "dspark", {**desc, "mtp.2.attn.wq_c.weight": "W8A8_DYNAMIC"})
    # a quantized draft layer whose scale is missing from the files
    with pytest.raises(W8A8Error, match=r"mtp\.0\.main_proj\.weight_scale"):
        _draft(path, "dspark", drop="mtp.0.main_proj.weight_scale")


def test_the_trunk_still_skips_the_draft(quantized):
    """A W8A8 checkpoint with a quantized draft still serves without speculation: the trunk's
    loader leaves every mtp.* tensor to the draft."""
    from sglang_dsv4_ascend.quantization.w8a8 import load_w8a8_model_from_dir

    model = load_w8a8_model_from_dir(quantized("dspark"))
    assert not any(n.startswith("mtp.") for n, _ in model.named_parameters())
