"""Imported by every Python process of the CPU server test (test_whole_model.py puts this
folder on PYTHONPATH): the import stand-ins a CPU box needs (stubs.py), torch.cuda.Stream's
stand-in, and a probe that writes one JSON file from inside each process that constructs
SGLang's Kimi-K3 model class, saying whether the kimi_w31 plugin's hooks were applied in
that process at that moment. The process then waits there (KIMI_W31_TEST_PROBE_HOLD
seconds) so that no rank fails further on (CPU has no MoE kernels) and takes the others down
before each has reported; the test stops the server. Inert unless KIMI_W31_TEST_PROBE_DIR
is set.
"""

from __future__ import annotations

import importlib.abc
import json
import os
import sys
import time
from pathlib import Path

PROBE_DIR = os.environ.get("KIMI_W31_TEST_PROBE_DIR")
MODEL_MODULE = "sglang.srt.models.kimi_k3"
HOOK_TARGETS = (
    "sglang.srt.models.kimi_k3.KimiK3LinearForCausalLM.load_weights",
    "sglang.srt.layers.quantization.mxfp4.Mxfp4Config.get_quant_method",
)


def _record(model) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry

    try:
        from sglang.srt.runtime_context import get_parallel

        parallel = get_parallel()
        ranks = {"tp_rank": parallel.tp_rank, "tp_size": parallel.tp_size}
    except Exception as exc:  # what the probe could not read, said plainly
        ranks = {"error": repr(exc)}
    report = {
        "pid": os.getpid(),
        "model_class": type(model).__name__,
        "hooks": {t: t in HookRegistry._patched for t in HOOK_TARGETS},
        **ranks,
    }
    path = Path(PROBE_DIR) / f"built-{os.getpid()}.json"
    path.write_text(json.dumps(report))


class _WrapModelClass(importlib.abc.MetaPathFinder):
    """When the Kimi-K3 model module is imported, wrap its VL class's __init__."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MODEL_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            import importlib.util

            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            cls = module.KimiK3ForConditionalGeneration
            init = cls.__init__

            def __init__(self, *args, **kwargs):
                init(self, *args, **kwargs)
                _record(self)
                time.sleep(float(os.environ.get("KIMI_W31_TEST_PROBE_HOLD", "0")))

            cls.__init__ = __init__

        loader.exec_module = exec_module
        return spec


if PROBE_DIR:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import stubs  # noqa: E402

    stubs.install()
    import torch  # noqa: E402

    class _CpuStream:
        def __init__(self, *args, **kwargs) -> None:
            return None

    torch.cuda.Stream = _CpuStream
    sys.meta_path.insert(0, _WrapModelClass())
