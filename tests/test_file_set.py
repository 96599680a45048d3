"""The file set as the loader sees it: the converter's source reader and verify's own
derivation (`audit/served.py`) agree on which shards a source serves, over generated
directory layouts; both are held to SGLang's loader in tests/sglang/test_file_set_differential.py.
"""

from __future__ import annotations

import shutil

import numpy as np
from file_layouts import NESTED, layouts, write_layout
from hypothesis import HealthCheck, given, settings
from kimi_w31.converter.audit import verify
from kimi_w31.converter.audit.served import loaded_files, served_headers
from kimi_w31.converter.contract import INDEX_NAME
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.pipeline import ConvertOptions, convert
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.source import read_source
from kimi_w31.converter.source.local import LocalOrigin
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint
from safetensors.numpy import save_file

# Why a reader may refuse a layout: the file set itself, or an index that disagrees with it.
FILE_SET_CODES = {
    Code.SHARD_NOT_LOADED,
    Code.SHARD_MISSING,
    Code.TENSOR_IN_TWO_SHARDS,
    Code.FILE_MISSING,
    Code.INDEX_TENSOR_NOT_IN_SHARD,
    Code.INDEX_TENSOR_MISSING,
    Code.INDEX_WRONG_SHARD,
    Code.WEIGHT_MAP_ENTRY_UNSAFE,
}


def _converter(root):
    try:
        return read_source(root, str(root), LocalOrigin()), set()
    except Fatal as exc:
        return None, {p.code for p in exc.problems}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(layout=layouts())
def test_converter_and_verify_serve_the_same_shards(tmp_path_factory, layout):
    root = write_layout(tmp_path_factory.getbasetemp() / "file-set" / "src", layout)
    source, codes = _converter(root)
    files, problems = loaded_files(root)
    if source is None:
        assert codes and codes <= FILE_SET_CODES, codes
        return
    assert problems == [] and sorted(source.shard_files) == files
    headers, header_problems = served_headers(root)
    assert header_problems == []
    assert {t for h in headers.values() for t in h.tensors} == {
        t for h in source.headers.values() for t in h.tensors
    }


def test_a_source_without_index_is_converted_whole(tmp_path):
    """The case that dropped embeddings, final norm and lm_head: several top-level shards and
    no index. Every shard's tensors reach the output, and verify --source proves it."""
    src = tmp_path / "src"
    synth_checkpoint(src, SynthSpec(layers=3, experts=4, shards=3, k=64, n=32))
    (src / INDEX_NAME).unlink()
    out = tmp_path / "out"
    convert(ConvertOptions(str(src), out, manifest="kimi-k3-any"))
    report = verify(out, source=str(src), checksums=True)
    assert report.ok, [(c.name, c.codes) for c in report.checks if c.ok is False]
    served = {t for h in served_headers(src)[0].values() for t in h.tensors}
    assert len(served_headers(src)[0]) == 3 and "language_model.lm_head.weight" in served


def test_verify_finds_an_output_that_dropped_a_source_shard(tmp_path):
    """An output converted from part of the source (as the old reader did with every shard
    but model.safetensors) fails verify --source, which finds the source's shards itself."""
    src = tmp_path / "src"
    synth_checkpoint(src, SynthSpec(layers=3, experts=4, shards=2, k=64, n=32))
    (src / INDEX_NAME).unlink()
    part = tmp_path / "part"
    shutil.copytree(src, part)
    save_file({"language_model.extra_norm.weight": np.ones(8, np.uint8)}, src / "extra.safetensors")
    out = tmp_path / "out"
    convert(ConvertOptions(str(part), out, manifest="kimi-k3-any"))
    report = verify(out, source=str(src))
    assert Code.TENSOR_MISSING in report.check("source-tensors").codes


def _refusal(root) -> set[Code]:
    source, codes = _converter(root)
    assert source is None
    return codes


def test_the_loaders_rule_case_by_case(tmp_path):
    def layout(files, index=None, shared=False):
        return write_layout(tmp_path / "src", {"files": files, "index": index, "shared": shared})

    # An index entry the loader's glob cannot list: refused by both readers.
    for entry in ("sub/extra.safetensors", ".hidden.safetensors"):
        root = layout([entry], {entry: "plain"})
        assert Code.SHARD_NOT_LOADED in _refusal(root)
        assert Code.SHARD_NOT_LOADED in {p.code for p in loaded_files(root)[1]}
    root = layout(["model.safetensors"], {"model.safetensors": "dot-slash"})
    assert Code.SHARD_NOT_LOADED in _refusal(root)
    # No index: every top-level shard, hidden and nested ones left out, no name twice.
    root = layout(["model.safetensors", "extra.safetensors", ".hidden.safetensors", NESTED[0]])
    assert sorted(read_source(root, "src", LocalOrigin()).shard_files) == loaded_files(root)[0]
    assert loaded_files(root)[0] == ["extra.safetensors", "model.safetensors"]
    root = layout(["model.safetensors", "extra.safetensors"], shared=True)
    assert _refusal(root) == {Code.TENSOR_IN_TWO_SHARDS}
    # The one pair a loader reads as a single model.
    root = layout(["consolidated.safetensors", "model.safetensors"], shared=True)
    assert read_source(root, "src", LocalOrigin()).shard_files == ["model.safetensors"]
    assert loaded_files(root) == (["model.safetensors"], [])
    # With an index, a top-level shard it does not name is not served.
    root = layout(["model.safetensors", "extra.safetensors"], {"model.safetensors": "plain"})
    assert read_source(root, "src", LocalOrigin()).shard_files == ["model.safetensors"]
    assert loaded_files(root) == (["model.safetensors"], [])
