"""The published Kimi-K3 checkpoint, replicated from headers: `tools/replica.py` (and so
`synth`'s published layout) reproduces every figure the public sources give for it, and
synth writes its shards exactly as the safetensors library does."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from kimi_w31.converter.safetensors_format import parse_header_bytes
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import replica  # noqa: E402

# moonshotai/Kimi-K3 as published (docs/inventory.md, section 6, cites each figure): the
# repository tree and the 96 shard headers.
PUBLISHED = {
    "tensors": 497_220,
    "shards": 96,
    "dtypes": {"U8": 494_592, "BF16": 2_122, "F32": 506},
    "tensor_bytes": 1_560_860_324_864,
    "file_bytes": 1_560_936_091_448,
}
# Shard sizes: the first (layer 0), the smallest (the projector), the largest (a KDA + MoE
# layer), the last (the vision tower).
PUBLISHED_SHARD_BYTES = {"first": 2_341_216_112, "min": 92_289_328, "max": 16_990_916_912}
PUBLISHED_LAST_SHARD = 802_448_352


@pytest.fixture(scope="module")
def real() -> dict:
    return replica.figures(replica.replica_spec(real_dims=True, layers=93, experts=896))


def test_the_real_dims_replica_has_the_published_figures(real):
    assert {k: real[k] for k in PUBLISHED} == PUBLISHED
    assert real["shard_names"] == [f"model-{i:05d}-of-000096.safetensors" for i in range(1, 97)]
    sizes = real["shard_bytes"]
    assert {"first": sizes[0], "min": min(sizes), "max": max(sizes)} == PUBLISHED_SHARD_BYTES
    assert sizes[-1] == PUBLISHED_LAST_SHARD


def test_a_published_offset_is_where_the_replica_puts_it():
    """layers.4.block_sparse_moe.experts.0.w1.weight_packed starts at byte 1,268,562,960 of
    model-00005 (a public dequantization check read it there): the library's order (F32, then
    BF16, then U8, each by name) and the header length both hold."""
    name, header, _, size = replica._shards(replica.REAL)[4]
    assert name == "model-00005-of-000096.safetensors"
    parsed = parse_header_bytes(name, header[8:], size)
    info = parsed.tensors[
        "language_model.model.layers.4.block_sparse_moe.experts.0.w1.weight_packed"
    ]
    assert info.begin == 1_268_562_960
    assert "__metadata__" not in header[8:].decode()


@pytest.mark.parametrize("spec", [SynthSpec(layers=3, experts=4), SynthSpec(layers=5, experts=2)])
def test_synth_writes_the_replica_headers_and_the_library_agrees(tmp_path, spec):
    """Negative control for the figures: synth's files have exactly the replica's headers,
    and the safetensors library, re-saving what it reads, writes the same bytes."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    synth_checkpoint(tmp_path / "src", spec)
    shards = replica._shards(spec)
    for name, header, _, size in shards:
        data = (tmp_path / "src" / name).read_bytes()
        assert data[: len(header)] == header and len(data) == size
        save_file(load_file(tmp_path / "src" / name), tmp_path / "again.safetensors")
        assert (tmp_path / "again.safetensors").read_bytes() == data, name
    assert torch is not None


def test_the_converted_replica_keeps_a_file_in_a_subfolder(tmp_path):
    spec = replica.replica_spec(real_dims=False, layers=3, experts=4)
    info = replica.write_source_replica(tmp_path / "src", spec)
    assert info["shards"] == 6 and (tmp_path / "src" / "assets" / "kimi-logo.png").is_file()
    replica.write_converted_replica(tmp_path / "src", tmp_path / "out", manifest="kimi-k3-any")
    logo = tmp_path / "out" / "assets" / "kimi-logo.png"
    assert logo.read_bytes() == (tmp_path / "src" / "assets" / "kimi-logo.png").read_bytes()
