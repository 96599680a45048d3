"""The `kimi_w31` config block: validation, cross-checks, unwrapping (no SGLang needed)."""

from __future__ import annotations

import copy
import types

import pytest
from kimi_w31.adapter.layout import (
    OPT_IN_ENV,
    LayoutError,
    W31Layout,
    check_against_model,
    find_block,
    load_layout,
    opt_in_unconverted,
    parse_block,
    unwrap_quantization_config,
)

BLOCK = {
    "format_version": 1,
    "fc1_layout": "w31",
    "fc1_order": ["up", "gate"],
    "activation": "situ",
    "situ_beta": 4.0,
    "situ_linear_beta": 25.0,
    "weight_format": "mxfp4",
    "group_size": 32,
    "converter": "kimi-w31 0.1.0",  # extra fields are allowed
}
BASE_QC = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"}
TEXT = {"hidden_act": "situ", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0}


def converted(**text_overrides) -> dict:
    return {
        "kimi_w31": dict(BLOCK),
        "quantization_config": {"quant_method": "kimi_w31", "base": dict(BASE_QC)},
        "text_config": {**TEXT, **text_overrides},
    }


def test_valid_block_parses():
    assert parse_block(BLOCK) == W31Layout(1, 4.0, 25.0, 32)


@pytest.mark.parametrize(
    ("key", "value", "fragment"),
    [
        ("format_version", 2, "format_version"),
        ("fc1_order", ["gate", "up"], "fc1_order"),
        ("fc1_layout", "w13", "fc1_layout"),
        ("activation", "swiglu", "activation"),
        ("group_size", 16, "group_size"),
        ("weight_format", "nvfp4", "weight_format"),
        ("situ_beta", "4", "situ_beta"),
        ("situ_linear_beta", -1.0, "situ_linear_beta"),
    ],
)
def test_each_bad_field_is_named(key, value, fragment):
    with pytest.raises(LayoutError, match=fragment):
        parse_block({**BLOCK, key: value})


def test_every_problem_is_reported_at_once():
    with pytest.raises(LayoutError) as err:
        parse_block({**BLOCK, "fc1_order": ["gate", "up"], "situ_beta": None})
    assert "fc1_order" in str(err.value) and "situ_beta" in str(err.value)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ({"activation_situ_beta": 3.0}, "situ_beta"),
        ({"activation_situ_linear_beta": 20.0}, "situ_linear_beta"),
        ({"hidden_act": "silu"}, "hidden_act"),
    ],
)
def test_block_must_agree_with_the_model_config(override, fragment):
    with pytest.raises(LayoutError, match=fragment) as err:
        load_layout(converted(**override))
    assert "convert it again" in str(err.value)


def test_block_found_on_object_configs_top_level_and_text_config():
    text = types.SimpleNamespace(**TEXT)
    top = types.SimpleNamespace(text_config=text, kimi_w31=dict(BLOCK))
    assert find_block(top) == BLOCK
    nested = types.SimpleNamespace(text_config=types.SimpleNamespace(**TEXT, kimi_w31=BLOCK))
    assert find_block(nested) == BLOCK
    assert find_block(types.SimpleNamespace(text_config=text)) is None
    check_against_model(parse_block(BLOCK), top)


def test_unwrap_restores_the_original_everywhere_and_is_idempotent():
    cfg = converted()
    cfg["text_config"]["quantization_config"] = copy.deepcopy(cfg["quantization_config"])
    assert unwrap_quantization_config(cfg) == 2
    assert cfg["quantization_config"] == BASE_QC
    assert cfg["text_config"]["quantization_config"] == BASE_QC
    assert unwrap_quantization_config(cfg) == 0


def test_unwrap_on_transformers_like_objects():
    obj = types.SimpleNamespace(quantization_config={"quant_method": "kimi_w31", "base": BASE_QC})
    assert unwrap_quantization_config(obj) == 1
    assert obj.quantization_config == BASE_QC


@pytest.mark.parametrize(
    "wrapper",
    [
        {"quant_method": "kimi_w31"},
        {"quant_method": "kimi_w31", "base": {"format": "x"}},
        {"quant_method": "kimi_w31", "base": {"quant_method": "kimi_w31", "base": BASE_QC}},
    ],
)
def test_malformed_wrappers_are_refused(wrapper):
    with pytest.raises(LayoutError, match="kimi_w31"):
        unwrap_quantization_config({"quantization_config": wrapper})


@pytest.mark.parametrize(
    ("value", "expected"), [("", False), ("0", False), ("1", True), ("yes", True)]
)
def test_opt_in_values(value, expected):
    assert opt_in_unconverted({OPT_IN_ENV: value}) is expected


def test_opt_in_garbage_is_an_error():
    with pytest.raises(LayoutError, match=OPT_IN_ENV):
        opt_in_unconverted({OPT_IN_ENV: "please"})
