"""Unit tests of the pure parts: header writer/reader, manifest rules, the planner.

The planner tests build sources from headers alone (no tensor bytes exist at all).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from kimi_w31.converter.errors import ConvertError
from kimi_w31.converter.manifest import Dims, load_manifest, parse_expert
from kimi_w31.converter.plan import pack_shards, plan_conversion
from kimi_w31.converter.safetensors_format import (
    HeaderEntry,
    ShardHeader,
    TensorInfo,
    build_header,
    parse_header_bytes,
    read_header,
)
from kimi_w31.converter.source import Source
from kimi_w31.converter.synth import SynthSpec, make_config, write_safetensors
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# -- writer against the safetensors library ---------------------------------------------


def test_written_file_reads_back_through_safetensors(tmp_path):
    rng = np.random.default_rng(1)
    a = rng.integers(0, 255, (7, 5), dtype=np.uint8)
    b = rng.standard_normal((3, 4)).astype(np.float32)
    path = tmp_path / "x.safetensors"
    write_safetensors(path, [("a", "U8", (7, 5), a), ("b", "F32", (3, 4), b)])
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0  # data section aligned like the library's own writer
    with safe_open(str(path), framework="np") as fh:
        assert fh.metadata() == {"format": "pt"}
        np.testing.assert_array_equal(fh.get_tensor("a"), a)
        np.testing.assert_array_equal(fh.get_tensor("b"), b)
    loaded = load_file(str(path))
    assert loaded["a"].dtype == torch.uint8 and loaded["b"].shape == (3, 4)


def test_reader_accepts_library_written_files(tmp_path):
    path = tmp_path / "lib.safetensors"
    save_file({"w": torch.zeros(4, 8, dtype=torch.bfloat16), "s": torch.ones(3, dtype=torch.uint8)},
              str(path), metadata={"format": "pt"})  # fmt: skip
    header = read_header(path)
    assert header.tensors["w"].dtype == "BF16" and header.tensors["w"].nbytes == 64
    assert header.tensors["s"].shape == (3,)


@pytest.mark.parametrize(
    ("header", "message"),
    [
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],'
         b'"data_offsets":[0,2]}}', "duplicate key"),
        (b'{"a":{"dtype":"Q9","shape":[2],"data_offsets":[0,2]}}', "unknown dtype"),
        (b'{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,2]}}', "byte size disagrees"),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],'
         b'"data_offsets":[1,3]}}', "overlaps"),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', "leaves a gap"),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[2,0]}}', "out of order"),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0.0,2]}}', "two integers"),
        (b'{"__metadata__":{"x":1}}', "__metadata__"),
        (b"\xff\xfe", "not UTF-8"),
        (b"[1,2]", "not a JSON object"),
        (b'{"a":', "not valid JSON"),
    ],
)  # fmt: skip
def test_header_rules_one_error_per_reason(header, message):
    with pytest.raises(ConvertError) as exc:
        parse_header_bytes("f.safetensors", header, 8 + len(header) + 2)
    assert message in exc.value.problems[0].render()
    assert "f.safetensors" in exc.value.problems[0].render()


def test_trailing_bytes_rejected():
    body = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    with pytest.raises(ConvertError, match="trailing bytes"):
        parse_header_bytes("f", body, 8 + len(body) + 5)


def test_build_header_round_trips():
    entries = [HeaderEntry("x", "U8", (4, 2), 8), HeaderEntry("y", "BF16", (3,), 6)]
    raw = build_header(entries)
    parsed = parse_header_bytes("f", raw[8:], len(raw) + 14)
    assert parsed.tensors["y"].begin == len(raw) + 8 and parsed.tensors["y"].shape == (3,)


# -- manifest rules ----------------------------------------------------------------------


def test_expert_names_need_an_experts_path_component():
    m = load_manifest("kimi-k3-any")
    e = parse_expert(m, "language_model.model.layers.4.mlp.experts.17.w3.weight_scale")
    assert (e.prefix, e.expert, e.proj, e.suffix) == (
        "language_model.model.layers.4.mlp.", 17, "w3", "weight_scale")  # fmt: skip
    assert parse_expert(m, "model.layers.0.mlp.shared_experts.w1.weight") is None
    assert parse_expert(m, "model.layers.0.mlp.shared_experts.0.w1.weight_packed") is None
    assert parse_expert(m, "mtp.0.experts.3.w1.weight_packed").prefix == "mtp.0."


def test_shape_formulas():
    d = Dims({"K": 3584, "N": 3072})
    assert d.shape(["N", "K/2"]) == (3072, 1792)
    assert d.shape(["2*N", "K/32"]) == (6144, 112)
    assert d.shape(["K", "N/32"]) == (3584, 96)
    assert Dims({"K": 100}).shape(["K/32"]) is None  # inexact: reported as a config problem


def test_official_manifest_pins_real_model():
    m = load_manifest("kimi-k3")
    assert m.raw["pinned"] == {"num_hidden_layers": 93, "num_experts": 896,
                               "routed_expert_hidden_size": 3584, "moe_intermediate_size": 3072,
                               "num_experts_per_token": 16}  # fmt: skip
    assert (m.situ_beta, m.situ_linear_beta) == (4.0, 25.0)


# -- planner on headers only --------------------------------------------------------------


def _header_only_source(spec: SynthSpec, split_partner: bool = True) -> Source:
    """A Source whose shards exist only as parsed headers (offsets are made up)."""
    k, n = spec.k, spec.n
    files: dict[str, dict[str, TensorInfo]] = {"a.safetensors": {}, "b.safetensors": {}}
    cursor = {"a.safetensors": 100, "b.safetensors": 100}

    def add(file, name, shape):
        nbytes = int(np.prod(shape))
        files[file][name] = TensorInfo(name, "U8", shape, cursor[file], cursor[file] + nbytes)
        cursor[file] += nbytes

    add("a.safetensors", "model.embed.weight", (16, 16))
    for layer in range(spec.layers):
        for e in range(spec.experts):
            p = f"language_model.model.layers.{layer}.mlp.experts.{e}."
            for proj, rows, cols in (("w1", n, k), ("w2", k, n), ("w3", n, k)):
                file = (
                    "b.safetensors"
                    if split_partner and proj == "w3" and e == 1
                    else "a.safetensors"
                )
                add(file, p + proj + ".weight_packed", (rows, cols // 2))
                add(file, p + proj + ".weight_scale", (rows, cols // 32))
    headers = {f: ShardHeader(f, cursor[f], 100, t, {}, f"h-{f}") for f, t in files.items()}
    weight_map = {name: f for f, t in files.items() for name in t}
    return Source(None, "mem", make_config(spec), weight_map, list(files), headers)


def test_plan_fuses_up_then_gate_as_byte_ranges():
    spec = SynthSpec(layers=2, experts=4)
    src = _header_only_source(spec)
    plan = plan_conversion(src, load_manifest("kimi-k3-any"), max_shard_size=1 << 40)
    tensors = {t.name: t for s in plan.shards for t in s.tensors}
    w31 = tensors["language_model.model.layers.0.mlp.experts.1.w31.weight_packed"]
    up = src.headers["b.safetensors"].tensors[
        "language_model.model.layers.0.mlp.experts.1.w3.weight_packed"
    ]
    gate = src.headers["a.safetensors"].tensors[
        "language_model.model.layers.0.mlp.experts.1.w1.weight_packed"
    ]
    pieces = [(p.file, p.offset, p.length) for p in w31.pieces]
    assert pieces == [
        ("b.safetensors", up.begin, up.nbytes),
        ("a.safetensors", gate.begin, gate.nbytes),
    ]
    assert w31.shape == (2 * spec.n, spec.k // 2)
    assert plan.experts_fused == 8
    assert not any(".w1." in n or ".w3." in n for n in tensors)
    assert sum(1 for n in tensors if ".w31." in n) == 2 * 4 * 2


def test_plan_never_splits_a_tensor_and_names_shards_like_hf():
    spec = SynthSpec(layers=2, experts=4)
    plan = plan_conversion(_header_only_source(spec), load_manifest("kimi-k3-any"),
                           max_shard_size=20_000)  # fmt: skip
    assert len(plan.shards) > 2
    n = len(plan.shards)
    assert [s.name for s in plan.shards] == [f"model-{i:05d}-of-{n:05d}.safetensors"
                                             for i in range(1, n + 1)]  # fmt: skip
    assert all(s.data_size <= 20_000 or len(s.tensors) == 1 for s in plan.shards)
    assert sum(len(s.tensors) for s in plan.shards) == plan.tensors_copied


def test_plan_reports_every_problem_at_once():
    spec = SynthSpec(layers=1, experts=4)
    src = _header_only_source(spec)
    a = src.headers["a.safetensors"].tensors
    name = "language_model.model.layers.0.mlp.experts.2.w2.weight_scale"
    a[name] = TensorInfo(name, "I8", a[name].shape, a[name].begin, a[name].end)
    gone = "language_model.model.layers.0.mlp.experts.3.w1.weight_packed"
    del a[gone]
    with pytest.raises(ConvertError) as exc:
        plan_conversion(src, load_manifest("kimi-k3-any"))
    text = "\n".join(p.render() for p in exc.value.problems)
    assert name in text and "wrong dtype" in text
    assert gone in text and "missing" in text


def test_pack_shards_is_order_preserving():
    from kimi_w31.converter.plan import OutputTensor, Piece

    ts = [
        OutputTensor(f"t{i}", "U8", (s,), (Piece("f", 0, s),), s)
        for i, s in enumerate([5, 5, 5, 20, 1])
    ]
    shards = pack_shards(ts, 10)
    assert [[t.name for t in s.tensors] for s in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]


@pytest.mark.parametrize("name", ["model.layers.0.mlp.experts.7.w31.weight_packed", 'odd"name\\é'])
def test_fast_header_formatting_equals_json_dumps(name):
    import json

    entries = [HeaderEntry(name, "U8", (4, 2), 8), HeaderEntry("s", "F32", (), 4)]
    doc = {"__metadata__": {"format": "pt"},
           name: {"dtype": "U8", "shape": [4, 2], "data_offsets": [0, 8]},
           "s": {"dtype": "F32", "shape": [], "data_offsets": [8, 12]}}  # fmt: skip
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    assert build_header(entries) == struct.pack("<Q", len(body)) + body


def test_importing_the_converter_never_imports_sglang_flashinfer_or_torch():
    import subprocess
    import sys

    code = (
        "import sys, kimi_w31.converter.cli, kimi_w31.converter.convert, "
        "kimi_w31.converter.verify\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'sglang', 'flashinfer', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
