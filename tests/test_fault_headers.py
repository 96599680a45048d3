"""Hostile safetensors headers: property tests of the parser, and every case via the CLI.

The parser's contract: for any bytes, either a `ShardHeader` whose tensors tile the data
section exactly (and that the safetensors library itself opens the same way), or a
`Fatal` with at least one problem naming the file. Never another exception.
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import faults as fl
import pytest
from hypothesis import assume, example, given
from hypothesis import strategies as st
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.safetensors_format import (
    DTYPE_BITS,
    MAX_HEADER_BYTES,
    HeaderEntry,
    ShardHeader,
    build_header,
    parse_header_bytes,
    read_header,
    tensor_nbytes,
)

FAST = fl.fuzz(150)

# dtypes the safetensors library maps one byte or more per element (used for the
# differential check; sub-byte F4/F6 are checked by our own rules only).
LIB_DTYPES = [
    "U8",
    "I8",
    "BOOL",
    "F16",
    "BF16",
    "I16",
    "U16",
    "F32",
    "I32",
    "U32",
    "F64",
    "I64",
    "U64",
]


def parse_or_error(raw: bytes, file_size: int) -> ShardHeader | Fatal:
    try:
        return parse_header_bytes("f.safetensors", raw, file_size)
    except Fatal as exc:
        assert exc.problems and all(p.file == "f.safetensors" for p in exc.problems)
        return exc


def assert_tiles(header: ShardHeader) -> None:
    """What an accepted header guarantees: offsets tile [data_start, file_size) exactly."""
    cursor = header.data_start
    for t in sorted(header.tensors.values(), key=lambda t: t.begin):
        assert t.begin == cursor and t.nbytes == tensor_nbytes(t.dtype, t.shape)
        cursor = t.end
    assert cursor == header.file_size


@FAST
@given(raw=st.binary(max_size=600), file_size=st.integers(0, 1 << 40))
@example(raw=b'{"a": ' + b"9" * 5000 + b"}", file_size=0)  # beyond Python's int digit limit
@example(raw=b'{"a": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", file_size=0)  # recursion
@example(
    raw=b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}, "a": 1}', file_size=80
)  # duplicate key: json.loads would keep the last silently
def test_random_bytes_never_crash(raw: bytes, file_size: int) -> None:
    result = parse_or_error(raw, file_size)
    if isinstance(result, ShardHeader):
        assert_tiles(result)


json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 70), 1 << 70),
    st.floats(allow_nan=True),
    st.text(max_size=6),
)
offsets = st.one_of(
    st.lists(st.integers(-64, 4096), min_size=2, max_size=2),
    st.lists(json_scalars, max_size=3),
    json_scalars,
)
shapes = st.one_of(
    st.lists(st.integers(0, 64), max_size=3),
    st.lists(st.integers(-4, 64), max_size=3),
    st.lists(json_scalars, max_size=2),
    json_scalars,
)
dtypes = st.one_of(st.sampled_from(sorted(DTYPE_BITS)), st.text(max_size=5), json_scalars)
entries = st.one_of(
    st.fixed_dictionaries({"dtype": dtypes, "shape": shapes, "data_offsets": offsets}),
    st.dictionaries(st.sampled_from(["dtype", "shape", "data_offsets", "x"]), json_scalars),
    json_scalars,
)
metadata = st.one_of(
    st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=4), json_scalars, max_size=3),
    json_scalars,
)


@FAST
@given(
    doc=st.dictionaries(st.text(max_size=8), entries, max_size=6),
    meta=st.one_of(st.just(None), metadata),
    data_len=st.integers(0, 4096),
    dup=st.booleans(),
)
def test_structured_headers_never_crash(doc: dict, meta, data_len: int, dup: bool) -> None:
    if meta is not None:
        doc = {"__metadata__": meta, **doc}
    text = json.dumps(doc)
    if dup and doc:  # the same key again: Python's json would silently keep the last one
        key = next(iter(doc))
        text = text[:-1] + ", " + json.dumps({key: doc[key]})[1:]
    raw = text.encode()
    result = parse_or_error(raw, 8 + len(raw) + data_len)
    if dup and doc:
        assert isinstance(result, Fatal)
        # NaN/Infinity (Python's json writes them; no JSON reader of the library's reads them)
        # are refused while parsing, before the duplicate is seen.
        try:
            json.dumps(doc, allow_nan=False)
            nonstandard = False
        except ValueError:
            nonstandard = True
        want = Code.HEADER_NOT_JSON if nonstandard else Code.HEADER_DUPLICATE_KEY
        assert result.codes[0] is want
    if isinstance(result, ShardHeader):
        assert_tiles(result)


@st.composite
def valid_shards(draw) -> tuple[list[HeaderEntry], dict[str, str]]:
    names = draw(
        st.lists(
            st.text("abcdefgh.0123", min_size=1, max_size=10), unique=True, min_size=1, max_size=8
        )
    )
    out = []
    for name in names:
        dtype = draw(st.sampled_from(LIB_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
        out.append(HeaderEntry(name, dtype, shape, tensor_nbytes(dtype, shape)))
    meta = draw(st.dictionaries(st.text("xyz", max_size=3), st.text(max_size=3), max_size=2))
    return out, meta


@FAST
@given(shard=valid_shards())
def test_valid_headers_roundtrip_and_the_library_agrees(shard) -> None:
    from safetensors import safe_open

    entries, meta = shard
    blob = build_header(entries, meta)
    data = bytes(sum(e.nbytes for e in entries))
    header = parse_header_bytes("f", blob[8:], len(blob) + len(data))
    assert_tiles(header)
    assert {n: (t.dtype, t.shape) for n, t in header.tensors.items()} == {
        e.name: (e.dtype, e.shape) for e in entries
    }
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.safetensors"
        path.write_bytes(blob + data)
        assert read_header(path).tensors == header.tensors  # file reader == bytes parser
        with safe_open(str(path), framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                s = f.get_slice(name)
                assert (s.get_dtype(), tuple(s.get_shape())) == (
                    header.tensors[name].dtype,
                    header.tensors[name].shape,
                )


MUTATIONS = {
    "dtype": lambda e, d: e.update(dtype="U9"),
    "shape": lambda e, d: e.update(shape=[*e["shape"], 2]),
    "negative": lambda e, d: e.update(data_offsets=[-1, e["data_offsets"][1]]),
    "float": lambda e, d: e.update(data_offsets=[float(x) for x in e["data_offsets"]]),
    "reverse": lambda e, d: e.update(data_offsets=e["data_offsets"][::-1]),
    "shift": lambda e, d: e.update(data_offsets=[x + d for x in e["data_offsets"]]),
    "extra": lambda e, d: e.update(extra=1),
}


@FAST
@given(
    shard=valid_shards(),
    which=st.sampled_from(sorted(MUTATIONS)),
    delta=st.integers(1, 64),
    trailing=st.integers(-8, 8),
)
def test_one_wrong_field_is_always_reported(shard, which: str, delta: int, trailing: int) -> None:
    entries, meta = shard
    nonempty = [e for e in entries if e.nbytes]
    assume(nonempty or which in ("dtype", "extra", "float"))
    blob = build_header(entries, meta)
    doc = json.loads(blob[8:])
    target = (nonempty or entries)[0].name
    if which == "shape" and not doc[target]["shape"]:
        doc[target]["shape"] = [3]  # a scalar's shape: make it disagree with its size
    else:
        MUTATIONS[which](doc[target], delta)
    raw = json.dumps(doc).encode()
    data_len = sum(e.nbytes for e in entries)
    result = parse_or_error(raw, 8 + len(raw) + data_len)
    assert isinstance(result, Fatal), which
    # Right header, wrong file size (truncated / trailing bytes): also always reported.
    if trailing:
        result = parse_or_error(blob[8:], len(blob) + max(0, data_len + trailing))
        assert isinstance(result, Fatal) or data_len + trailing < 0


@FAST
@given(
    length=st.one_of(st.integers(0, (1 << 64) - 1), st.sampled_from([0, MAX_HEADER_BYTES + 1])),
    body=st.binary(max_size=64),
)
def test_read_header_length_field(
    tmp_path_factory: pytest.TempPathFactory, length: int, body: bytes
) -> None:
    path = tmp_path_factory.getbasetemp() / "len.safetensors"
    path.write_bytes(struct.pack("<Q", length) + body)
    try:
        header = read_header(path)
    except Fatal as exc:
        assert exc.problems[0].file == str(path)
        return
    assert 0 < length <= len(body)
    assert_tiles(header)


def test_every_hostile_header_is_a_clean_cli_error(tmp_path: Path) -> None:
    template = fl.make_source(tmp_path / "template", experts=4)  # 6 shards: VICTIM
    rows = fl.header_cases(template, tmp_path / "work")
    assert len(rows) == len(fl.HEADER_CASES) >= 25
    assert not fl.bad_rows(rows, {fl.CLEAN}), fl.bad_rows(rows, {fl.CLEAN})


def test_headers_the_library_refuses_are_clean_errors_in_convert_and_verify(tmp_path: Path):
    """Each form Python's json reads and the library refuses: convert refuses it in a source
    shard, and verify reports it planted in an output whose checksums were re-forged."""
    from faults import library as flib

    template = fl.make_source(tmp_path / "template", experts=4)  # 6 shards: VICTIM
    rows = flib.source_header_cases(template, tmp_path / "src")
    rows += flib.output_header_cases(template, tmp_path / "out")
    assert len(rows) == 2 * len(flib.LIBRARY_HEADER_CASES)
    assert not fl.bad_rows(rows, {fl.CLEAN}), fl.bad_rows(rows, {fl.CLEAN})
