"""Shared fixtures: small synthetic checkpoints, converted once per session where possible."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from kimi_w31.converter.contract import STATE_DIR
from kimi_w31.converter.pipeline import ConvertOptions, convert
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint


@pytest.fixture(scope="session")
def small_source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("src") / "ckpt"
    synth_checkpoint(root, SynthSpec(layers=3, experts=8))
    return root


@pytest.fixture(scope="session")
def converted(small_source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out") / "conv"
    convert(ConvertOptions(str(small_source), out, manifest="kimi-k3-any", max_shard_size=600_000))
    return out


@pytest.fixture
def source_copy(small_source, tmp_path) -> Path:
    dst = tmp_path / "src"
    shutil.copytree(small_source, dst)
    return dst


@pytest.fixture
def output_copy(converted, tmp_path) -> Path:
    dst = tmp_path / "out"
    # Without the record a verify of the shared conversion may have left: it covers those
    # files, not this copy.
    shutil.copytree(converted, dst, ignore=shutil.ignore_patterns(STATE_DIR))
    return dst
