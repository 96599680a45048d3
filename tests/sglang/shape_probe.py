"""Run in a fresh process by test_shape_differential.py: build SGLang 0.5.23's whole Kimi-K3
model (KimiK3ForConditionalGeneration) on CPU for each config directory given, and measure,
for each (tensor name, shape) asked, what the model's own `load_weights` does with a tensor
of that shape: how many parameter elements it writes, in which parameters, or the error.

usage: python shape_probe.py CASES_JSON OUT_JSON

CASES_JSON: [{"dir": MODEL_DIR, "tensors": [[NAME, SHAPE], ...], "whole": [[NAME, SHAPE], ...]}]

"Written" is measured: every floating-point parameter is filled with NaN, one tensor of
values in [1, 2) is loaded, and every element now in [1, 2) was written from it (the fused
parameters included: the slice it fills); elements written with anything else ("other":
SGLang zero-pads a merged parameter's slice from a tensor too short for it) are counted
apart. `whole` is loaded one after the other into one
NaN-filled model; the elements still NaN after it, per parameter, are reported.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import harness  # noqa: E402  (import stand-ins first)
import torch  # noqa: E402


def _floats(model) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.dtype.is_floating_point}


def _fill(params: dict[str, torch.Tensor]) -> None:
    for p in params.values():
        p.data.fill_(float("nan"))


def _load(model, name: str, shape: list[int]) -> str | None:
    tensor = torch.rand(shape, dtype=torch.float32, generator=torch.Generator().manual_seed(0))
    try:  # values in [1, 1.75]: still in [1, 2) after rounding to bfloat16
        model.load_weights([(name, (tensor * 0.75 + 1).to(torch.bfloat16))])
    except Exception as exc:  # what SGLang does with it is the measurement
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def probe(model_dir: str, tensors: list, whole: list) -> dict:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import _get_quantization_config, _initialize_model
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import process_model_config

    with harness.sglang_process(model_dir, arch="sm90"), harness.cpu_cuda_streams():
        model_config = process_model_config()
        load_config = LoadConfig()
        quant_config = _get_quantization_config(model_config, load_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = _initialize_model(model_config, load_config, quant_config)
        params = _floats(model)
        measured = []
        _fill(params)
        touched: dict[str, torch.Tensor] = {}
        for name, shape in tensors:
            _fill(touched)  # only what the last tensor wrote is not NaN
            error = _load(model, name, shape)
            # the tensor's values are in [1, 2): anything else written (SGLang zero-pads a
            # short slice of a merged parameter) is not the tensor's
            carried, other, touched = {}, {}, {}
            for n, p in params.items():
                written = int((~torch.isnan(p.data)).sum())
                if not written:
                    continue
                touched[n] = p
                mine = int(((p.data >= 1) & (p.data < 2)).sum())
                if mine:
                    carried[n] = mine
                if written - mine:
                    other[n] = written - mine
            measured.append(
                {"name": name, "shape": shape, "error": error, "written": carried, "other": other}
            )
        _fill(params)
        errors = [e for n, s in whole if (e := _load(model, n, s))]
        unwritten = {n: int(torch.isnan(p.data).sum()) for n, p in params.items()}
        return {
            "model_class": type(model).__name__,
            "measured": measured,
            "whole_errors": errors,
            "params": {n: list(p.shape) for n, p in params.items()},
            "unwritten": {n: c for n, c in unwritten.items() if c},
        }


def main(cases_json: str, out_json: str) -> None:
    from sglang.srt.models import kimi_k3

    # The post-load step (weight merging, kv_b absorption) is not loading.
    kimi_k3.KimiK3LinearForCausalLM.post_load_weights = lambda self: None
    cases = json.loads(Path(cases_json).read_text())
    reports = [probe(c["dir"], c["tensors"], c["whole"]) for c in cases]
    Path(out_json).write_text(json.dumps(reports))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
