"""Run in a fresh process by test_plugin_wiring.py: load plugins like SGLang does, then
report (as JSON on the last line) what got hooked and how SGLang treats the checkpoints.

usage: python wiring_probe.py SOURCE_DIR CONVERTED_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import harness  # noqa: E402  (import stand-ins first)
import torch  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

TARGETS = {
    "get_config": "sglang.srt.utils.hf_transformers.config.get_config",
    "load_weights": "sglang.srt.models.kimi_k3.KimiK3LinearForCausalLM.load_weights",
    "get_quant_method": "sglang.srt.layers.quantization.mxfp4.Mxfp4Config.get_quant_method",
    "check_server_args": "sglang.srt.server_args.ServerArgs.check_server_args",
}


def main(source_dir: str, converted_dir: str) -> dict:
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    report: dict = {
        "wrapped": {k: v in HookRegistry._patched for k, v in TARGETS.items()},
        "kimi_w31_known": "kimi_w31" in QUANTIZATION_METHODS,
    }
    try:
        with harness.sglang_process(converted_dir, arch="sm120"):
            report["converted_quantization"] = harness.process_hf_config() and (
                __import__("sglang.srt.runtime_context", fromlist=["x"])
                .process_model_config()
                .quantization
            )
    except Exception as exc:  # what a user of stock SGLang would see
        report["converted_error"] = f"{type(exc).__name__}: {exc}"
    # The stock loader fed the converted tensors (on a source config, so SGLang can start).
    tensors = load_file(str(Path(converted_dir) / "model.safetensors"))
    with harness.sglang_process(source_dir, arch="sm120"):
        moe = harness.build_moe(experts=4, hidden=256, inter=256, layer_id=0)
        model = harness.FakeK3Text(harness.process_hf_config().text_config, [moe])
        harness.load_with_real_loader(
            model, {k: v for k, v in tensors.items() if ".layers.0." in k}
        )
        report["w13_all_zero"] = bool(torch.count_nonzero(moe.w13_weight) == 0)
        report["w2_loaded"] = bool(torch.count_nonzero(moe.w2_weight) > 0)
    return report


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2])))
