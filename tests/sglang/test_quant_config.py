"""The `kimi_w31` quantization method: a converted checkpoint is quantized like its source."""

from __future__ import annotations

import json

import pytest
from harness import sglang_process

pytestmark = pytest.mark.sglang


def _summary(qc) -> dict:
    """What SGLang's layers read off a compressed-tensors config."""
    return {
        "type": type(qc).__name__,
        "quant_format": qc.quant_format,
        "ignore": list(qc.ignore),
        "targets": sorted(qc.target_scheme_map),
        "schemes": repr(sorted(qc.target_scheme_map.items())),
    }


def _quant_config(path) -> tuple[str, dict]:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.weight_utils import get_quant_config
    from sglang.srt.runtime_context import process_model_config

    with sglang_process(path, arch="sm120"):
        mc = process_model_config()
        qc = get_quant_config(mc, LoadConfig(), packed_modules_mapping={})
        return mc.quantization, _summary(qc)


def test_converted_checkpoint_gets_the_sources_quantization(plugins, source_dir, converted_dir):
    method_src, src = _quant_config(source_dir)
    method_out, out = _quant_config(converted_dir)
    assert method_src == method_out == "compressed-tensors"
    assert out == src
    # Kimi-K3 switches its MoE to Mxfp4Config on this (kimi_k3.py:489-499)
    assert "mxfp4" in out["quant_format"]


def test_wrapped_config_builds_the_base_method(plugins, source_dir, converted_dir):
    """A config that still carries the wrapper (e.g. handed over by other code) resolves to
    the original method's config object through the registered `kimi_w31` name."""
    from kimi_w31.adapter.sglang.quant_config import KimiW31Config
    from sglang.srt.layers.quantization import get_quantization_config

    wrapper = json.loads((converted_dir / "config.json").read_text())["text_config"]
    wrapper = wrapper["quantization_config"]  # as published: inside text_config
    base = json.loads((source_dir / "config.json").read_text())["text_config"]
    base = base["quantization_config"]
    assert wrapper["quant_method"] == "kimi_w31"
    cls = get_quantization_config("kimi_w31")
    assert cls is KimiW31Config
    built = cls.from_config({**wrapper, "packed_modules_mapping": {}})
    expected = get_quantization_config("compressed-tensors").from_config(
        {**base, "packed_modules_mapping": {}}
    )
    assert _summary(built) == _summary(expected)
    with pytest.raises(TypeError, match="from_config"):
        KimiW31Config()


def test_a_block_that_disagrees_with_the_model_stops_config_loading(
    plugins, tmp_path, source_config, converted_tensors
):
    """Raised while SGLang reads config.json, i.e. in the launching process already."""
    import harness
    from kimi_w31.adapter.layout import LayoutError

    cfg = harness.converted_config(source_config)
    cfg["kimi_w31"]["situ_linear_beta"] = 20.0
    path = harness.write_checkpoint(tmp_path / "bad", cfg, converted_tensors)
    with pytest.raises(LayoutError, match="situ_linear_beta"), sglang_process(path):
        pass
