"""How `w8a8_ascend` claims ModelSlim checkpoints in SGLang's quantization detection."""

from sglang_dsv4_ascend.names import QUANT_METHOD as NAME
from sglang_dsv4_ascend.quantization.w8a8_ascend import W8A8AscendConfig

DSV4_DESC = {
    "quant_method": "modelslim",
    "model_quant_type": "W8A8_DYNAMIC",
    "layers.0.attn.wq_a.weight": "W8A8_DYNAMIC",
    "layers.0.attn.wo_a.weight": "FLOAT",
}
OTHER_DESC = {"quant_method": "modelslim", "model.layers.0.self_attn.q_proj.weight": "W8A8_DYNAMIC"}


def test_claims_dsv4_modelslim_with_or_without_the_flag():
    for user in (None, "modelslim", NAME):
        assert W8A8AscendConfig.override_quantization_method(DSV4_DESC, user) == NAME


def test_leaves_other_checkpoints_to_sglang():
    assert W8A8AscendConfig.override_quantization_method(OTHER_DESC, None) is None
    assert W8A8AscendConfig.override_quantization_method(OTHER_DESC, "modelslim") is None
    assert W8A8AscendConfig.override_quantization_method({"quant_method": "fp8"}, NAME) is None
    assert W8A8AscendConfig.override_quantization_method(None, NAME) is None
    # An explicit request is honoured for any ModelSlim description (the model then names what it lacks).
    assert W8A8AscendConfig.override_quantization_method(OTHER_DESC, NAME) == NAME


def test_config_keeps_the_description_without_sglangs_marker():
    cfg = W8A8AscendConfig.from_config(dict(DSV4_DESC))
    assert cfg.get_name() == NAME and cfg.get_config_filenames() == ["quant_model_description.json"]
    assert "quant_method" not in cfg.description
    assert cfg.description["layers.0.attn.wq_a.weight"] == "W8A8_DYNAMIC"
