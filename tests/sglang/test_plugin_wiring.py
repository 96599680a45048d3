"""The plugin as SGLang loads it: a real entry point, in fresh processes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.sglang

PROBE = Path(__file__).with_name("wiring_probe.py")


def _probe(source_dir: Path, converted_dir: Path, **env: str) -> dict:
    full_env = {**os.environ, **env}
    for name in ("KIMI_W31_SERVE_UNCONVERTED", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(name, None)
    proc = subprocess.run(
        [sys.executable, str(PROBE), str(source_dir), str(converted_dir)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_entry_point_installs_every_hook(source_dir, converted_dir):
    report = _probe(source_dir, converted_dir)
    assert report["wrapped"] == {
        "get_config": True,
        "load_weights": True,
        "get_quant_method": True,
        "check_server_args": True,
    }
    assert report["kimi_w31_known"] is True
    # the converted config resolves to its original method, as the source does
    assert report["converted_quantization"] == "compressed-tensors"
    assert "converted_error" not in report
    # with the hook, converted w31 names reach the experts even through a stock method
    assert report["w13_all_zero"] is False


def test_sglang_plugins_filter_and_stock_sglang_fails_closed(source_dir, converted_dir):
    """With the plugin filtered out, SGLang is stock: it refuses the converted config, and
    its loader would silently drop every w31 tensor (why the config must refuse)."""
    report = _probe(source_dir, converted_dir, SGLANG_PLUGINS="someone_else")
    assert not any(report["wrapped"].values())
    assert report["kimi_w31_known"] is False
    assert "Unknown quantization method: kimi_w31" in report["converted_error"]
    assert report["w13_all_zero"] is True and report["w2_loaded"] is True


def test_sglang_plugins_naming_us_keeps_the_plugin(source_dir, converted_dir):
    report = _probe(source_dir, converted_dir, SGLANG_PLUGINS="kimi_w31")
    assert all(report["wrapped"].values())


_BUNDLE_PROBE = """
import json, sys
sys.path.insert(0, sys.argv[2])
import harness  # noqa: F401  (import stand-ins first)
from sglang.srt.plugins import load_plugins
load_plugins()  # the plugin's register: its first action is the bundle's pre-flight
from sglang.srt.utils.hf_transformers import config as C
out = {}
try:
    C.get_config(sys.argv[1], trust_remote_code=False)
    out["config"] = "read"
except Exception as exc:
    out["error"] = type(exc).__name__
    out["codes"] = list(getattr(exc, "codes", ()))  # a refusal's codes (strings)
print(json.dumps(out))
"""


def _bundle_probe(converted_dir: Path, **env: str) -> dict:
    full_env = {**os.environ, **env}
    proc = subprocess.run(
        [sys.executable, "-c", _BUNDLE_PROBE, str(converted_dir), str(PROBE.parent)],
        capture_output=True,
        text=True,
        env=full_env,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_bad_bundle_stops_the_process_at_its_first_config_read(converted_dir, tmp_path):
    """Through SGLang's own hook registry: with KIMI_W31_KERNELS naming a missing directory
    or a bundle of another stack, the first config read of the process raises the refusal
    (before any model is built, let alone a weight loaded)."""
    from kimi_w31.adapter.reasons import AdapterCode
    from test_kernel_bundle import STACK, write_bundle

    missing = _bundle_probe(converted_dir, KIMI_W31_KERNELS=str(tmp_path / "gone"))
    assert missing == {"error": "BundleError", "codes": ["kernel-bundle-missing"]}
    other = write_bundle(tmp_path / "other", stack=dataclasses.replace(STACK, flashinfer="0.6.18"))
    refused = _bundle_probe(converted_dir, KIMI_W31_KERNELS=str(other))
    assert refused["error"] == "BundleError"
    assert AdapterCode.KERNEL_BUNDLE_FLASHINFER.value in refused["codes"]
    assert _bundle_probe(converted_dir) == {"config": "read"}  # no bundle named: untouched
