"""Unit tests of the pure parts: header writer/reader, manifests, the planner.

The planner tests build sources from headers alone (no tensor bytes exist at all).
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.manifest import Dims, load_manifest
from kimi_w31.converter.plan import OutputTensor, Piece, pack_shards, plan_conversion
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.safetensors_format import (
    DTYPE_BITS,
    HeaderEntry,
    build_header,
    parse_header_bytes,
    read_header,
)
from kimi_w31.converter.synth import SynthSpec, make_config, write_safetensors
from kimi_w31.converter.validate import validate_source
from safetensors import safe_open
from safetensors.numpy import load_file, save_file
from sources import header_only_source, synth_source

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
    assert loaded["a"].dtype == np.uint8 and loaded["b"].shape == (3, 4)


def test_reader_accepts_library_written_files(tmp_path):
    path = tmp_path / "lib.safetensors"
    save_file(
        {"w": np.zeros((4, 8), dtype=np.float16), "s": np.ones(3, dtype=np.uint8)},
        str(path),
        metadata={"format": "pt"},
    )
    header = read_header(path)
    assert header.tensors["w"].dtype == "F16" and header.tensors["w"].nbytes == 64
    assert header.tensors["s"].shape == (3,)


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (
            b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"a":{"dtype":"U8","shape":[2],'
            b'"data_offsets":[0,2]}}',
            Code.HEADER_DUPLICATE_KEY,
        ),
        (b'{"a":{"dtype":"Q9","shape":[2],"data_offsets":[0,2]}}', Code.HEADER_DTYPE),
        (b'{"a":{"dtype":"U8","shape":[3],"data_offsets":[0,2]}}', Code.HEADER_SIZE_MISMATCH),
        (
            b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"b":{"dtype":"U8","shape":[2],'
            b'"data_offsets":[1,3]}}',
            Code.HEADER_OVERLAP,
        ),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[1,3]}}', Code.HEADER_GAP),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[2,0]}}', Code.HEADER_OFFSETS),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0.0,2]}}', Code.HEADER_OFFSETS),
        (b'{"a":{"dtype":"U8","shape":[-2],"data_offsets":[0,2]}}', Code.HEADER_SHAPE),
        (b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2],"x":1}}', Code.HEADER_ENTRY),
        (b'{"__metadata__":{"x":1}}', Code.HEADER_METADATA),
        (b"\xff\xfe", Code.HEADER_NOT_UTF8),
        (b"[1,2]", Code.HEADER_NOT_JSON),
        (b'{"a":', Code.HEADER_NOT_JSON),
    ],
)
def test_header_rules_one_code_per_reason(header, code):
    with pytest.raises(Fatal) as exc:
        parse_header_bytes("f.safetensors", header, 8 + len(header) + 2)
    assert exc.value.codes[0] == code
    assert exc.value.problems[0].file == "f.safetensors"


def sub_byte(dtype: str) -> Code:
    """The code for a sub-byte dtype whose elements do not fill whole bytes; a library that
    predates the dtype (F4/F6 came with 0.6) reads it as unknown."""
    return Code.HEADER_SUB_BYTE if dtype in DTYPE_BITS else Code.HEADER_DTYPE


@pytest.mark.parametrize(
    ("prefix", "size", "code"),
    [
        (b"\x01\x02", 2, Code.HEADER_TOO_SMALL),
        ((0).to_bytes(8, "little"), 100, Code.HEADER_LENGTH_ZERO),
        ((200_000_000).to_bytes(8, "little"), 300_000_000, Code.HEADER_TOO_LARGE),
        ((500).to_bytes(8, "little"), 100, Code.HEADER_BEYOND_FILE),
    ],
)
def test_header_length_rules_one_code_per_reason(prefix, size, code):
    from kimi_w31.converter.safetensors_format import check_header_length

    with pytest.raises(Fatal) as exc:
        check_header_length("f.safetensors", prefix, size)
    assert exc.value.codes == [code]


@pytest.mark.parametrize(
    ("extra", "code"), [(5, Code.FILE_TRAILING_BYTES), (-1, Code.FILE_TRUNCATED)]
)
def test_file_size_must_match_the_header(extra, code):
    body = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    with pytest.raises(Fatal) as exc:
        parse_header_bytes("f", body, 8 + len(body) + 2 + extra)
    assert exc.value.codes == [code]


U8_1 = '"dtype":"U8","shape":[1],"data_offsets":[0,1]'


@pytest.mark.parametrize(
    ("header", "data", "code"),
    [
        # the library's size arithmetic: a left fold in a usize, then bits, then whole bytes
        ('{"a":{"dtype":"U8","shape":[4294967296,4294967296,0],"data_offsets":[0,0]}}', 0,
         Code.HEADER_OVERFLOW),
        ('{"a":{"dtype":"F64","shape":[1152921504606846976],"data_offsets":[0,0]}}', 0,
         Code.HEADER_OVERFLOW),
        ('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', 2, sub_byte("F4")),
        ('{"a":{"dtype":"F6_E2M3","shape":[3],"data_offsets":[0,3]}}', 3, sub_byte("F6_E2M3")),
        # integers serde_json does not read as a usize, though Python's json reads an int
        ('{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}', 0, Code.HEADER_SHAPE),
        ('{"a":{"dtype":"U8","shape":[0],"data_offsets":[-0,0]}}', 0, Code.HEADER_OFFSETS),
        ('{"a":{"dtype":"U8","shape":[0,18446744073709551616],"data_offsets":[0,0]}}', 0,
         Code.HEADER_SHAPE),
        ('{"__metadata__":{"k":18446744073709551617}}', 0, Code.HEADER_METADATA),
        # JSON Python's json reads and serde_json does not
        ('{"a\\ud800":{' + U8_1 + "}}", 1, Code.HEADER_NOT_JSON),
        ('{"a\\udc00\\ud800":{' + U8_1 + "}}", 1, Code.HEADER_NOT_JSON),
        ('{"a":{' + U8_1 + '},"__metadata__":{"k":NaN}}', 1, Code.HEADER_NOT_JSON),
        ('{"a":{"dtype":"U8","shape":[Infinity],"data_offsets":[0,1]}}', 1,
         Code.HEADER_NOT_JSON),
    ],
)  # fmt: skip
def test_library_rules_one_code_per_reason(tmp_path, header, data, code):
    """Headers the safetensors library refuses that Python's json alone would pass: ours
    refuses each with its own code, and the library refuses it too."""
    from safetensors import safe_open

    raw = header.encode()
    with pytest.raises(Fatal) as exc:
        parse_header_bytes("f.safetensors", raw, 8 + len(raw) + data)
    assert exc.value.codes[0] == code
    path = tmp_path / "f.safetensors"
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + bytes(data))
    with pytest.raises(Exception), safe_open(str(path), framework="numpy"):  # noqa: B017
        pass


@pytest.mark.parametrize(
    ("entry", "code"),
    [
        (HeaderEntry("x", "F4", (3,), 2), sub_byte("F4")),
        (HeaderEntry("x", "U8", (1 << 40, 1 << 40, 0), 0), Code.HEADER_OVERFLOW),
        (HeaderEntry("x\ud800", "U8", (1,), 1), Code.HEADER_NOT_JSON),
        (HeaderEntry("x", "U9", (1,), 1), Code.HEADER_DTYPE),
        (HeaderEntry("x", "U8", (2,), 1), Code.HEADER_SIZE_MISMATCH),
    ],
)
def test_build_header_never_writes_what_the_reader_refuses(entry, code):
    with pytest.raises(Fatal) as exc:
        build_header([HeaderEntry("ok", "U8", (1,), 1), entry])
    assert exc.value.codes[0] == code


def test_build_header_round_trips():
    entries = [HeaderEntry("x", "U8", (4, 2), 8), HeaderEntry("y", "BF16", (3,), 6)]
    raw = build_header(entries)
    parsed = parse_header_bytes("f", raw[8:], len(raw) + 14)
    assert parsed.tensors["y"].begin == len(raw) + 8 and parsed.tensors["y"].shape == (3,)


# -- manifests ---------------------------------------------------------------------------


def test_shape_formulas():
    d = Dims({"K": 3584, "N": 3072})
    assert d.shape(("N", "K/2")) == (3072, 1792)
    assert d.shape(("2*N", "K/32")) == (6144, 112)
    assert d.shape(("K", "N/32")) == (3584, 96)
    assert Dims({"K": 100}).shape(("K/32",)) is None  # inexact: reported as a config problem


def test_official_manifest_pins_real_model():
    m = load_manifest("kimi-k3")
    assert m.pinned == {
        "num_hidden_layers": 93,
        "num_experts": 896,
        "routed_expert_hidden_size": 3584,
        "moe_intermediate_size": 3072,
        "num_experts_per_token": 16,
    }
    assert (m.situ_beta, m.situ_linear_beta) == (4.0, 25.0)


@pytest.mark.parametrize(
    ("text", "code"),
    [
        (None, Code.MANIFEST_NOT_FOUND),  # the path does not exist
        ("[]", Code.MANIFEST_INVALID),
        ("{", Code.MANIFEST_INVALID),
        ('{"name": "x"}', Code.MANIFEST_INVALID),  # no dims: the missing key is named
    ],
)
def test_manifest_errors_are_usage_errors_with_a_reason(tmp_path, text, code):
    path = tmp_path / "m.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(Fatal) as exc:
        load_manifest(str(path))
    assert exc.value.codes == [code] and exc.value.exit_code == 2


def test_unknown_manifest_name_lists_the_bundled_ones():
    with pytest.raises(Fatal) as exc:
        load_manifest("kimi-k9")
    assert exc.value.codes == [Code.MANIFEST_NOT_FOUND]
    assert "kimi-k3-any" in exc.value.problems[0].expected


# -- planner on headers only --------------------------------------------------------------


def _plan(spec: SynthSpec, max_shard_size: int = 1 << 40, **placement):
    source, _ = synth_source(spec, **placement)
    table, problems = validate_source(source, load_manifest("kimi-k3-any"))
    assert problems == []
    return source, plan_conversion(source, table, max_shard_size)


def test_plan_fuses_up_then_gate_as_byte_ranges():
    spec = SynthSpec(layers=2, dense_layers=0, experts=4)
    up_name = "language_model.model.layers.0.block_sparse_moe.experts.1.w3.weight_packed"
    src, plan = _plan(spec, **{up_name: 1})  # the up half in the other file
    tensors = {t.name: t for s in plan.shards for t in s.tensors}
    w31 = tensors["language_model.model.layers.0.block_sparse_moe.experts.1.w31.weight_packed"]
    up = src.headers["s1.safetensors"].tensors[up_name]
    gate_name = "language_model.model.layers.0.block_sparse_moe.experts.1.w1.weight_packed"
    gate_file = next(f for f, h in src.headers.items() if gate_name in h.tensors)
    gate = src.headers[gate_file].tensors[gate_name]
    pieces = [(p.file, p.offset, p.length) for p in w31.pieces]
    assert pieces == [("s1.safetensors", up.begin, up.nbytes), (gate_file, gate.begin, gate.nbytes)]
    assert w31.shape == (2 * spec.n, spec.k // 2)
    assert plan.experts_fused == 8
    assert not any(".w1." in n or ".w3." in n for n in tensors if ".experts." in n)
    assert sum(1 for n in tensors if ".w31." in n) == 2 * 4 * 2


def test_plan_never_splits_a_tensor_and_names_shards_like_hf():
    _, plan = _plan(SynthSpec(layers=2, experts=4), max_shard_size=20_000)
    n = len(plan.shards)
    assert n > 2
    assert [s.name for s in plan.shards] == [
        f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)
    ]
    assert all(s.data_size <= 20_000 or len(s.tensors) == 1 for s in plan.shards)
    assert sum(len(s.tensors) for s in plan.shards) == plan.tensors


def test_validation_reports_every_problem_at_once():
    spec = SynthSpec(layers=2, experts=4)
    source, tensors = synth_source(spec)
    p = "language_model.model.layers.1.block_sparse_moe.experts."
    edited = [
        (n, "I8" if n == p + "2.w2.weight_scale" else d, s)
        for n, d, s in tensors
        if n != p + "3.w1.weight_packed"
    ]
    source = header_only_source(edited, make_config(spec), files=2)
    _, problems = validate_source(source, load_manifest("kimi-k3-any"))
    assert {(p.code, p.tensor) for p in problems} >= {
        (Code.EXPERT_DTYPE, p + "2.w2.weight_scale"),
        (Code.EXPERT_PARTNER_MISSING, p + "3.w1.weight_packed"),
    }


def test_pack_shards_is_order_preserving():
    ts = [
        OutputTensor(f"t{i}", "U8", (s,), (Piece("f", 0, s),), s)
        for i, s in enumerate([5, 5, 5, 20, 1])
    ]
    shards = pack_shards(ts, 10)
    assert [[t.name for t in s.tensors] for s in shards] == [["t0", "t1"], ["t2"], ["t3"], ["t4"]]


@given(
    tensors=st.lists(
        st.tuples(
            st.integers(0, 50),
            st.text(alphabet=st.sampled_from(list('ax"\\\n\x01\u00e9\U0001f600')), max_size=60),
        ),
        min_size=1,
        max_size=40,
    ),
    max_header=st.integers(400, 5000),
)
@example(tensors=[(1, "\U0001f600" * 60)] * 40, max_header=2000)  # 12 bytes a character
@example(tensors=[(1, '"\\' * 30)] * 40, max_header=2000)  # 2 bytes a character
def test_pack_shards_bounds_every_header(tensors, max_header):
    """Many small tensors must not make a header the safetensors library cannot open: a
    shard starts before its header could pass the bound (unless one tensor alone does),
    whatever the names need in JSON escapes."""
    ts = [
        OutputTensor(f"t{i}{name}", "U8", (s,), (Piece("f", 0, s),), s)
        for i, (s, name) in enumerate(tensors)
    ]
    shards = pack_shards(ts, 1 << 40, max_header)
    assert [t.name for s in shards for t in s.tensors] == [t.name for t in ts]
    for shard in shards:
        assert len(shard.header) - 8 <= max_header or len(shard.tensors) == 1
        parsed = parse_header_bytes(shard.name, shard.header[8:], shard.file_size)
        assert list(parsed.tensors) == [t.name for t in shard.tensors]


def test_a_source_of_many_small_tensors_plans_readable_shards():
    """The class 'header over the library's limit': thousands of tiny tensors whose headers
    together exceed a bound are split over several shards, each readable."""
    spec = SynthSpec(layers=2, experts=2, k=64, n=32)
    source, tensors = synth_source(spec)
    tiny = [(f"model.extra.{i:06d}." + "n" * 400, "U8", (1,)) for i in range(3000)]
    source = header_only_source(tensors + tiny, make_config(spec), files=2)
    table, problems = validate_source(source, load_manifest("kimi-k3-any"))
    assert problems == []
    plan = plan_conversion(source, table, 1 << 40, max_header=1_000_000)
    assert len(plan.shards) > 1
    assert all(len(s.header) - 8 <= 1_000_000 for s in plan.shards)


@pytest.mark.parametrize("name", ["model.layers.0.mlp.experts.7.w31.weight_packed", 'odd"name\\é'])
def test_fast_header_formatting_equals_json_dumps(name):
    import json

    entries = [HeaderEntry(name, "U8", (4, 2), 8), HeaderEntry("s", "F32", (), 4)]
    doc = {
        "__metadata__": {"format": "pt"},
        name: {"dtype": "U8", "shape": [4, 2], "data_offsets": [0, 8]},
        "s": {"dtype": "F32", "shape": [], "data_offsets": [8, 12]},
    }
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % 8)
    assert build_header(entries) == struct.pack("<Q", len(body)) + body


def test_importing_the_converter_never_imports_sglang_flashinfer_torch_or_the_adapter():
    import subprocess
    import sys

    code = (
        "import sys, kimi_w31.converter.cli.convert, kimi_w31.converter.pipeline, "
        "kimi_w31.converter.audit\n"
        "print(sorted({m for m in sys.modules if m.split('.')[0] in ('sglang', 'flashinfer', "
        "'torch') or m.startswith('kimi_w31.adapter')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_tensor_whose_own_header_entry_passes_the_limit_is_refused():
    """Packing can split shards, not names: a 100 MB name is refused with its reason, and
    every shard over the bound is named at once."""
    small = OutputTensor("small", "U8", (1,), (Piece("f", 0, 1),), 1)
    huge = [OutputTensor(c * 100_000_000, "U8", (1,), (Piece("f", 0, 1),), 1) for c in "nm"]
    with pytest.raises(Fatal) as exc:
        pack_shards([huge[0], small, huge[1]], 1 << 40)
    assert exc.value.codes == [Code.OUTPUT_HEADER_TOO_LARGE] * 2
    assert [p.file for p in exc.value.problems] == [
        "model-00001-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ]


@given(
    prefix=st.sampled_from(["language_model.model.layers.1.mlp.", "model.layers.0.mlp.", ""]),
    part=st.sampled_from(["experts.3.w1.", "experts.0.w31.", "shared_experts.", "experts.x."]),
    suffix=st.sampled_from(["weight_scale", "weight_packed", "weight", "input_scale"]),
    dtype=st.sampled_from(sorted(DTYPE_BITS)),
    every=st.booleans(),
)
def test_e8m0_scales_are_judged_by_dtype(prefix, part, suffix, dtype, every):
    """A tensor is scanned for 0xFF only where its bytes are E8M0: safetensors' E8M0 dtype,
    or a U8 routed-expert weight_scale (any U8 weight_scale with --check-scales); a scale
    of any other dtype (F32, BF16, ...) never is, whatever its name."""
    from kimi_w31.converter import contract

    name = prefix + part + suffix
    expert = contract.parse_expert_name(name) is not None
    want = dtype == "F8_E8M0" or (dtype == "U8" and suffix == "weight_scale" and (expert or every))
    assert contract.is_e8m0_scale(name, dtype, every) == want
