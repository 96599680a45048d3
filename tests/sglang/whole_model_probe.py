"""Run in fresh processes by test_whole_model.py: build SGLang 0.5.23's whole Kimi-K3 model
(KimiK3ForConditionalGeneration) on CPU from a checkpoint directory, load it through
SGLang's own weight reader and the model's own `load_weights`, and report (JSON, to a file)
which checkpoint tensors reached which parameters and which parameter bytes were never
written.

usage: python whole_model_probe.py MODEL_DIR OUT_JSON RANK WORLD CONFIGS [--stock]

CONFIGS: comma-separated ARCH:TP:EP (e.g. sm90:2:1,sm120:2:2), built one after the other;
every TP must equal WORLD. With WORLD > 1 the caller starts one process per rank
(MASTER_ADDR/MASTER_PORT set); each builds and loads its rank's model. --stock: the
plugin is not loaded (SGLang as shipped).

"Written" is measured, not inferred: every parameter is filled with bytes 0x00, the
checkpoint loaded, then filled with 0xFF and loaded again; a byte that differs between the
two loads was written by neither. A tensor "reached" a parameter when some parameter's
bytes changed while the loader held that tensor (the loader streams: it finishes one
tensor before it asks for the next). The model's post-load step (weight merging, kv_b
absorption, which rewrites no checkpoint bytes) is left out so the two loads see the
same parameters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import harness  # noqa: E402  (import stand-ins first)
import numpy as np  # noqa: E402
import torch  # noqa: E402


def _bytes(p: torch.Tensor) -> torch.Tensor:
    return p.data.detach().reshape(-1).view(torch.uint8)


def _load(model, weights, params: dict[str, torch.Tensor], fill: int, attribute: bool):
    for p in params.values():
        _bytes(p).fill_(fill)
    # bytes, not torch.equal: an order of magnitude faster on these small CPU tensors
    snap = {n: _bytes(p).numpy().tobytes() for n, p in params.items()}
    reached: dict[str, list[str]] = {}

    def stream():
        current = None
        for name, tensor in weights:
            if current is not None and attribute:
                _attribute(current)
            current = name
            yield name, tensor
        if current is not None and attribute:
            _attribute(current)

    def _attribute(name: str) -> None:
        changed = []
        for pname, p in params.items():
            now = _bytes(p).numpy().tobytes()
            if now != snap[pname]:
                changed.append(pname)
                snap[pname] = now
        reached[name] = changed

    model.load_weights(stream())
    return {n: _bytes(p).numpy().tobytes() for n, p in params.items()}, reached


def probe(model_dir: str, arch: str, tp: int, ep: int, rank: int) -> dict:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import (
        DefaultModelLoader,
        _get_quantization_config,
        _initialize_model,
    )
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import process_model_config

    report: dict = {}
    with (
        harness.sglang_process(
            model_dir, arch=arch, world_rank=rank, world_size=tp, tp_size=tp, ep_size=ep
        ),
        harness.cpu_cuda_streams(),
    ):
        model_config = process_model_config()
        load_config = LoadConfig()
        quant_config = _get_quantization_config(model_config, load_config)
        with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
            model = _initialize_model(model_config, load_config, quant_config)
        report["model_class"] = type(model).__name__
        params = dict(model.named_parameters())
        loader = DefaultModelLoader(load_config)
        first, reached = _load(
            model, loader._get_all_weights(model_config, model), params, 0x00, True
        )
        second, _ = _load(model, loader._get_all_weights(model_config, model), params, 0xFF, False)
        report["params"] = {
            name: {
                "shape": list(p.shape),
                "dtype": str(p.dtype),
                "bytes": len(first[name]),
                "unwritten": int(
                    np.count_nonzero(
                        np.frombuffer(first[name], np.uint8)
                        != np.frombuffer(second[name], np.uint8)
                    )
                ),
            }
            for name, p in params.items()
        }
        report["reached"] = reached
        moe = [m for m in model.modules() if type(m).__name__ in ("FusedMoE", "EPMoE")]
        report["moe_methods"] = sorted({type(m.quant_method).__name__ for m in moe})
        report["module_methods"] = {  # every other module with a quant method, by name
            name: type(m.quant_method).__name__
            for name, m in model.named_modules()
            if m not in moe and getattr(m, "quant_method", None) is not None
        }
        report["other_methods"] = sorted(
            {
                type(m.quant_method).__name__
                for m in model.modules()
                if m not in moe and getattr(m, "quant_method", None) is not None
            }
        )
    return report


def main(model_dir: str, out_json: str, rank: int, world: int, configs: str, stock: bool):
    from sglang.srt.models import kimi_k3
    from sglang.srt.plugins.hook_registry import HookRegistry

    if not stock:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    # The post-load step is not loading (see the module docstring).
    kimi_k3.KimiK3LinearForCausalLM.post_load_weights = lambda self: None
    reports = {}
    for config in configs.split(","):
        arch, tp, ep = config.split(":")
        assert int(tp) == world, "every config's TP is the world size"
        reports[config] = probe(model_dir, arch, int(tp), int(ep), rank)
    # whether the plugin's load hook was in place in this process (read after the builds)
    plugin = "sglang.srt.models.kimi_k3.KimiK3LinearForCausalLM.load_weights" in (
        HookRegistry._patched
    )
    Path(out_json).write_text(json.dumps({"plugin": plugin, "rank": rank, "configs": reports}))


if __name__ == "__main__":
    args = sys.argv[1:]
    stock = "--stock" in args
    args = [a for a in args if a != "--stock"]
    main(args[0], args[1], int(args[2]), int(args[3]), args[4], stock)
