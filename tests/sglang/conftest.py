"""Shared fixtures for the tests against the real SGLang 0.5.23 code (`make test-sglang`)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def _have_sglang() -> bool:
    # Not find_spec("sglang"): this very folder would pass for a namespace package.
    try:
        importlib.metadata.distribution("sglang")
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


if not _have_sglang():
    # The plain suite's venv has no SGLang: these tests run under `make test-sglang`.
    collect_ignore_glob = ["test_*.py"]
else:
    import harness  # noqa: F401  (installs the import stand-ins before SGLang is imported)

# Run first: the longest file (two real servers, the whole-model probes), so that under
# `make test-sglang`'s two workers the other one runs the rest meanwhile.
LONGEST_FIRST = ("test_whole_model.py",)


def pytest_collection_modifyitems(items: list) -> None:
    # A stable sort: each file's own order, and every other file's, is kept.
    items.sort(key=lambda item: item.path.name not in LONGEST_FIRST)


# Small, but 128-aligned like the kernels need: E experts, K hidden, N intermediate.
E, K, N, LAYERS = 4, 256, 256, 2


@pytest.fixture(autouse=True)
def _unverified_checkpoints_load(monkeypatch) -> None:
    """The synthetic checkpoints here are never run through `verify`: the load-time check
    against its record is opted out of, as an operator would, except where a test of that
    check removes the opt-out (test_served_checks.py)."""
    from kimi_w31.converter.output.verified import SKIP_ENV

    monkeypatch.setenv(SKIP_ENV, "1")


@pytest.fixture(scope="session")
def plugins() -> None:
    """Load plugins the way every SGLang process does: through the installed entry point."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    load_plugins()
    assert "sglang.srt.models.kimi_k3.KimiK3LinearForCausalLM.load_weights" in (
        HookRegistry._patched
    ), "the kimi_w31 plugin's hooks were not applied: is the project installed in this venv?"


@pytest.fixture(scope="session")
def source_tensors() -> dict:
    return harness.source_tensors(experts=E, hidden=K, inter=N, layers=LAYERS, seed=1)


@pytest.fixture(scope="session")
def source_config() -> dict:
    return harness.source_config(experts=E, hidden=K, inter=N, layers=LAYERS)


@pytest.fixture(scope="session")
def source_dir(tmp_path_factory, source_config, source_tensors) -> Path:
    return harness.write_checkpoint(tmp_path_factory.mktemp("src"), source_config, source_tensors)


@pytest.fixture(scope="session")
def converted_tensors(source_tensors) -> dict:
    return harness.fuse(source_tensors)


@pytest.fixture(scope="session")
def converted_dir(tmp_path_factory, source_config, converted_tensors) -> Path:
    return harness.write_checkpoint(
        tmp_path_factory.mktemp("out"),
        harness.converted_config(source_config),
        converted_tensors,
    )
