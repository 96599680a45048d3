"""The adapter's reading of the `kimi_w31` block: the contract's checks, raised as errors
with their reason codes (no SGLang needed)."""

from __future__ import annotations

import copy
import types
from pathlib import Path

import pytest
from kimi_w31.adapter.layout import (
    OPT_IN_ENV,
    LayoutError,
    W31Layout,
    find_block,
    load_layout,
    opt_in_unconverted,
    unwrap_quantization_config,
)
from kimi_w31.adapter.sglang import launch
from kimi_w31.converter import contract
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.synth import SynthSpec, make_config

SOURCE = make_config(SynthSpec())
QC = SOURCE["text_config"]["quantization_config"]  # published: inside text_config only
BLOCK = contract.make_block(4.0, 25.0, converter="kimi-w31 test")  # extra fields are allowed


def converted_cfg(**text_overrides) -> dict:
    config = contract.converted_config(SOURCE, BLOCK)
    config["text_config"].update(text_overrides)
    return config


def test_valid_block_loads():
    assert load_layout(converted_cfg()) == W31Layout(1, 4.0, 25.0, 32)
    assert load_layout(SOURCE) is None  # unconverted


@pytest.mark.parametrize(
    ("key", "value", "code"),
    [
        ("format_version", 2, Code.BLOCK_FIELD),
        ("fc1_order", ["gate", "up"], Code.BLOCK_FIELD),
        ("fc1_layout", "w13", Code.BLOCK_FIELD),
        ("activation", "swiglu", Code.BLOCK_FIELD),
        ("group_size", 16, Code.BLOCK_FIELD),
        ("weight_format", "nvfp4", Code.BLOCK_FIELD),
        ("situ_beta", "4", Code.BLOCK_FIELD),
        ("situ_linear_beta", -1.0, Code.BLOCK_FIELD),
    ],
)
def test_each_bad_field_has_its_code(key, value, code):
    config = converted_cfg()
    config["kimi_w31"][key] = value
    with pytest.raises(LayoutError) as err:
        load_layout(config)
    assert code.value in err.value.codes


def test_every_problem_is_reported_at_once():
    config = converted_cfg()
    config["kimi_w31"].update(fc1_order=["gate", "up"], situ_beta=None)
    with pytest.raises(LayoutError) as err:
        load_layout(config)
    assert err.value.codes.count(Code.BLOCK_FIELD.value) == 2


@pytest.mark.parametrize(
    "override",
    [{"activation_situ_beta": 3.0}, {"activation_situ_linear_beta": 20.0}, {"hidden_act": "silu"}],
)
def test_block_must_agree_with_the_model_config(override):
    with pytest.raises(LayoutError) as err:
        load_layout(converted_cfg(**override))
    assert err.value.codes == (Code.BLOCK_MISMATCH.value,)


def test_block_found_on_object_configs_top_level_and_text_config():
    text = types.SimpleNamespace(**SOURCE["text_config"])
    top = types.SimpleNamespace(text_config=text, kimi_w31=dict(BLOCK))
    assert find_block(top) == BLOCK
    assert load_layout(top) == W31Layout(1, 4.0, 25.0, 32)
    nested = types.SimpleNamespace(
        text_config=types.SimpleNamespace(**SOURCE["text_config"], kimi_w31=BLOCK)
    )
    assert find_block(nested) == BLOCK
    assert find_block(types.SimpleNamespace(text_config=text)) is None


def test_unwrap_restores_the_original_everywhere_and_is_idempotent():
    cfg = converted_cfg()
    cfg["quantization_config"] = copy.deepcopy(cfg["text_config"]["quantization_config"])
    assert unwrap_quantization_config(cfg) == 2
    assert cfg["quantization_config"] == QC
    assert cfg["text_config"]["quantization_config"] == QC
    assert unwrap_quantization_config(cfg) == 0


def test_unwrap_on_transformers_like_objects():
    base = QC
    obj = types.SimpleNamespace(quantization_config={"quant_method": "kimi_w31", "base": base})
    assert unwrap_quantization_config(obj) == 1
    assert obj.quantization_config == base


@pytest.mark.parametrize(
    "wrapper",
    [
        {"quant_method": "kimi_w31"},
        {"quant_method": "kimi_w31", "base": {"format": "x"}},
        {"quant_method": "kimi_w31", "base": {"quant_method": "kimi_w31", "base": {}}},
    ],
)
def test_malformed_wrappers_are_refused(wrapper):
    with pytest.raises(LayoutError) as err:
        unwrap_quantization_config({"quantization_config": wrapper})
    assert err.value.codes == (Code.NOT_WRAPPED.value,)


@pytest.mark.parametrize(
    ("value", "expected"), [("", False), ("0", False), ("1", True), ("yes", True)]
)
def test_opt_in_values(value, expected):
    assert opt_in_unconverted({OPT_IN_ENV: value}) is expected


def test_opt_in_garbage_is_an_error():
    with pytest.raises(LayoutError) as err:
        opt_in_unconverted({OPT_IN_ENV: "please"})
    assert err.value.codes == ("opt-in-value",) and err.value.exit_code == 1


def test_a_converted_synthetic_checkpoint_passes_the_adapters_checks(converted: Path):
    """synth -> convert -> the adapter's own checks (no SGLang): one contract for both."""
    import json

    config = json.loads((converted / "config.json").read_text())
    assert load_layout(config) == W31Layout(1, 4.0, 25.0, 32)
    assert unwrap_quantization_config(copy.deepcopy(config)) == 1
    plan = launch.plan_serve(converted, tp=1, ep=1, backend="marlin", gpu_memory=141 * 10**9)
    assert "--model-path" in plan.argv and str(converted) in plan.argv


def test_the_plugin_refuses_a_wrapper_without_a_block():
    pytest.importorskip("torch", reason="the plugin's hooks module imports torch")
    from kimi_w31.adapter.sglang import hooks

    config = converted_cfg()
    del config["kimi_w31"]
    with pytest.raises(LayoutError) as err:
        hooks.after_get_config(config)
    assert err.value.codes == (Code.BLOCK_MISSING.value,)
    assert (
        hooks.after_get_config(converted_cfg())["text_config"]["quantization_config"] == QC
    )  # a whole conversion is unwrapped for SGLang
