"""Our header reader against the safetensors library itself, over generated hostile headers.

The rule (converter/safetensors_format.py): a header is valid only if both readers accept
it and read every name, dtype, shape and offset alike. Headers are generated token by
token, so the forms Python's `json` and the library's serde_json read differently can be
drawn: number forms ("-0", exponents, floats, leading zeros, integers beyond 2^64 - 1,
1e400, NaN/Infinity), string escapes (lone and paired surrogates, \\u0000, invalid escapes,
raw control characters, bytes that are not UTF-8), dimension products that overflow, zero
dimensions, sub-byte dtypes, offsets that do not tile, `__metadata__` forms, duplicate
keys, whitespace and padding. Each header is written to a file (data as a hole) and read by
`safetensors.safe_open`, as every loader does, and by our reader. Both ways:

- whenever ours accepts, the library accepts and reads the same names, dtypes, shapes,
  metadata and offsets (offsets through the bytes the library hands back);
- whenever the library refuses, ours refuses, with reason codes;
- whenever the library accepts a header written in the forms we accept by design (no
  extra entry fields, no array or map forms, no duplicate keys), ours accepts it too.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import faults as fl
import pytest
from hypothesis import example, given, note
from hypothesis import strategies as st
from kimi_w31.converter.errors import Fatal
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.safetensors_format import (
    DTYPE_BITS,
    ShardHeader,
    library_problem,
    read_header,
)

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors._safetensors_rust import deserialize  # noqa: E402

DIFF = fl.fuzz(400)
USIZE_MAX = (1 << 64) - 1
DATA_CAP = 4096  # a file's data section is a hole; offsets are checked through `deserialize`

# Every dtype name any safetensors release knows, and names it never knew.
KNOWN_DTYPES = [
    "BOOL", "U8", "I8", "I16", "U16", "F16", "BF16", "I32", "U32", "F32", "I64", "U64",
    "F64", "F8_E5M2", "F8_E4M3", "F4", "F6_E2M3", "F6_E3M2", "F8_E8M0", "C64",
    "F8_E4M3FNUZ", "F8_E5M2FNUZ",
]  # fmt: skip
BOGUS_DTYPES = ["bool", "u8", "F8_E4M3FN", "U9", "", "F32 ", "FP4"]
DIMS = [0, 1, 2, 3, 4, 5, 7, 8, 1 << 32, 1 << 63, USIZE_MAX, USIZE_MAX + 1, 1 << 70]


class Doc:
    """A header being drawn: its bytes, and whether it used a form the library tolerates
    and our reader refuses by design (so the third property does not apply)."""

    def __init__(self, draw) -> None:
        self.draw = draw
        self.tolerated = False
        # A few hostile forms per header (often none), so that most headers fail on one
        # thing at most and the accepting side is explored as well as the refusing one.
        self.ints = ["plain"] * 6 + draw(st.lists(st.sampled_from(list(INT_FORMS)), max_size=1))
        self.strs = ["plain"] * 6 + draw(st.lists(st.sampled_from(list(STR_FORMS)), max_size=1))
        self.spaces = [b"", b"", b" ", b"\n", b"\t", b"\r"] + draw(
            st.lists(st.sampled_from(HOSTILE_WS), max_size=1)
        )

    def ws(self) -> bytes:
        return self.draw(st.sampled_from(self.spaces))

    def int_token(self, value: int) -> bytes:
        form = self.draw(st.sampled_from(self.ints))
        return INT_FORMS.get(form, lambda v: str(v))(value).encode()

    def str_token(self, text: str) -> bytes:
        form = self.draw(st.sampled_from(self.strs))
        body = json.dumps(text, ensure_ascii=False)[1:-1].encode()
        return b'"' + body + STR_FORMS.get(form, b"") + b'"'

    def obj(self, pairs: list[tuple[bytes, bytes]]) -> bytes:
        inner = b",".join(self.ws() + k + self.ws() + b":" + self.ws() + v for k, v in pairs)
        return b"{" + inner + self.ws() + b"}"

    def arr(self, items: list[bytes]) -> bytes:
        return b"[" + b",".join(self.ws() + i for i in items) + self.ws() + b"]"


HOSTILE_WS = [b"\x0c", b"\x0b", b"\xc2\xa0", b"\x00", b"\xef\xbb\xbf"]
INT_FORMS = {
    "neg0": lambda v: "-0" if v == 0 else f"-{v}",
    "exp": lambda v: f"{v}e0",
    "exp_upper": lambda v: f"{v}E+0",
    "float": lambda v: f"{v}.0",
    "lead0": lambda v: f"0{v}",
    "plus": lambda v: f"+{v}",
    "wrap": lambda v: str(v + (1 << 64)),
    "huge": lambda v: "1e400",
    "digits": lambda v: "9" * 25,
    "nan": lambda v: "NaN",
    "inf": lambda v: "Infinity",
    "neginf": lambda v: "-Infinity",
    "hex": lambda v: hex(v),
}
STR_FORMS = {
    "lone_high": b"\\ud800",
    "lone_low": b"\\udc00",
    "high_then_letter": b"\\ud800\\u0041",
    "two_high": b"\\ud800\\ud800",
    "pair": b"\\ud83d\\ude00",
    "pair_upper": b"\\uD83D\\uDE00",
    "nul": b"\\u0000",
    "escaped_solidus": b"\\/",
    "bad_escape": b"\\x41",
    "quote_escape": b"\\'",
    "short_hex": b"\\u12",
    "raw_ctrl": b"\x01",
    "raw_tab": b"\t",
    "raw_newline": b"\n",
    "raw_del": b"\x7f",
    "not_utf8": b"\xff",
    "encoded_surrogate": b"\xed\xa0\x80",
    "overlong": b"\xc0\xaf",
    "non_ascii": "é😀".encode(),
}


@st.composite
def hostile_headers(draw) -> tuple[bytes, int, bool]:
    """(header JSON bytes, data section length, tolerated-form flag)."""
    doc = Doc(draw)
    unique = draw(st.sampled_from([True, True, True, False]))
    names = draw(
        st.lists(st.sampled_from(["a", "b", "c", "w.0", "x-0"]), max_size=4, unique=unique)
    )
    if len(set(names)) != len(names):
        doc.tolerated = True  # the library keeps the last of a tensor given twice
    pairs: list[tuple[bytes, bytes]] = []
    offset = 0
    for name in names:
        dtype = draw(st.sampled_from(KNOWN_DTYPES * 3 + BOGUS_DTYPES))
        shape = draw(st.lists(st.one_of(st.integers(0, 8), st.sampled_from(DIMS)), max_size=4))
        bits = DTYPE_BITS.get(dtype, 8)
        count = 1
        for d in shape:
            count *= d
        size = draw(st.sampled_from([(count * bits + 7) // 8, (count * bits) // 8]))
        begin, end = offset, offset + size
        tweak = draw(st.sampled_from(["none"] * 20 + ["shift", "grow", "swap", "gap"]))
        if tweak == "shift":
            begin, end = begin + 1, end + 1
        elif tweak == "grow":
            end += 1
        elif tweak == "swap":
            begin, end = end, begin
        elif tweak == "gap":
            begin, end = begin + 2, end + 2
        offset = max(offset, end)
        fields = [
            (b'"dtype"', doc.str_token(dtype)),
            (b'"shape"', doc.arr([doc.int_token(d) for d in shape])),
            (b'"data_offsets"', doc.arr([doc.int_token(begin), doc.int_token(end)])),
        ]
        form = draw(st.sampled_from(["object"] * 30 + list(ENTRY_FORMS)))
        if form != "object":
            doc.tolerated |= form in TOLERATED_ENTRY_FORMS
            fields = ENTRY_FORMS[form](fields)
        if form == "array":
            entry = doc.arr([v for _, v in fields])
        else:
            entry = doc.obj(draw(st.permutations(fields)) if draw(st.booleans()) else fields)
        pairs.append((doc.str_token(name), entry))
    meta = draw(st.sampled_from(["absent"] * 8 + list(METADATA_FORMS)))
    if meta != "absent":
        doc.tolerated |= meta == "dup_inner"
        value = METADATA_FORMS[meta](doc)
        at = draw(st.integers(0, len(pairs)))
        pairs.insert(at, (doc.str_token("__metadata__"), value))
        if meta == "twice":
            pairs.append((b'"__metadata__"', b"{}"))
    body = doc.ws() + doc.obj(pairs) + draw(st.sampled_from([b"", b"   ", b"\n"] + doc.spaces))
    data_len = offset + draw(st.sampled_from([0] * 16 + [-1, 1, 3]))
    return body, min(max(0, data_len), 1 << 32), doc.tolerated


ENTRY_FORMS = {
    "extra": lambda f: [*f, (b'"x"', b"1")],
    "extra_nan": lambda f: [*f, (b'"x"', b"NaN")],
    "missing": lambda f: f[1:],
    "dup_field": lambda f: [*f, f[0]],
    "array": lambda f: f,
    "dtype_map": lambda f: [(b'"dtype"', b"{" + f[0][1] + b":null}"), *f[1:]],
    "dtype_number": lambda f: [(b'"dtype"', b"8"), *f[1:]],
}
TOLERATED_ENTRY_FORMS = {"extra", "array", "dtype_map"}
METADATA_FORMS = {
    "null": lambda d: b"null",
    "empty": lambda d: b"{}",
    "strings": lambda d: d.obj([(d.str_token("format"), d.str_token("pt"))]),
    "number_value": lambda d: d.obj([(b'"k"', d.int_token(1))]),
    "nan_value": lambda d: b'{"k":NaN}',
    "list": lambda d: b'["pt"]',
    "string": lambda d: b'"pt"',
    "dup_inner": lambda d: b'{"k":"1","k":"2"}',
    "twice": lambda d: b'{"k":"1"}',
}


def library(path: Path, blob: bytes | None) -> tuple[dict, dict | None, dict | None] | Exception:
    """What the library reads: {name: (dtype, shape)}, metadata, {name: data bytes} (None
    where the data section is a hole too large to hand over in memory)."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            tensors = {}
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                view = f.get_slice(name)
                tensors[name] = (view.get_dtype(), tuple(view.get_shape()))
            metadata = f.metadata()
    except Exception as exc:  # the library's refusal, whatever its type
        return exc
    if blob is None:
        return tensors, metadata, None
    data = {name: bytes(t["data"]) for name, t in deserialize(blob)}
    return tensors, metadata, data


def ours(path: Path) -> ShardHeader | Fatal:
    try:
        return read_header(path, "f.safetensors")
    except Fatal as exc:
        return exc


def check_both_ways(tmp: Path, body: bytes, data_len: int, tolerated: bool, say=print) -> None:
    # Data bytes that differ at every position, so a tensor's bytes locate its offsets.
    data = bytes((i * 7 + (i >> 8)) % 251 for i in range(min(data_len, DATA_CAP)))
    blob = struct.pack("<Q", len(body)) + body + data
    path = tmp / "h.safetensors"
    with open(path, "wb") as fh:
        fh.write(blob)
        fh.truncate(len(blob) + max(0, data_len - DATA_CAP))
    mine, lib = ours(path), library(path, blob if data_len <= DATA_CAP else None)
    say(f"body={body!r} data_len={data_len} ours={mine!r} library={lib!r}")
    if isinstance(mine, ShardHeader):
        assert not isinstance(lib, Exception), f"only ours accepts: {lib}"
        tensors, metadata, tensor_data = lib
        assert tensors == {n: (t.dtype, t.shape) for n, t in mine.tensors.items()}
        assert (metadata or {}) == mine.metadata
        for name, t in mine.tensors.items():
            assert tensor_data is None or tensor_data[name] == blob[t.begin : t.end]
    else:
        assert mine.problems and all(isinstance(p.code, Code) for p in mine.problems)
        if not tolerated:  # ours refuses: the library refuses too, or we are over-strict
            assert isinstance(lib, Exception), f"only the library accepts: {mine.codes}"
    if isinstance(lib, Exception):
        assert isinstance(mine, Fatal), "the library refuses and ours accepts"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("differential")


def _h(text: str) -> bytes:
    return text.encode()


E = '"dtype":"U8","shape":[{}],"data_offsets":[{},{}]'


@DIFF
@given(case=hostile_headers())
@example(case=(_h('{"a":{' + E.format("-0", 0, 0) + "}}"), 0, False))
@example(case=(_h('{"a":{' + E.format(0, "-0", 0) + "}}"), 0, False))
@example(case=(_h('{"a":{' + E.format(f"0,{USIZE_MAX + 1}", 0, 0) + "}}"), 0, False))
@example(case=(_h('{"a":{' + E.format(f"{1 << 32},{1 << 32},0", 0, 0) + "}}"), 0, False))
@example(case=(_h('{"a":{' + E.format(f"0,{1 << 32},{1 << 32}", 0, 0) + "}}"), 0, False))
@example(case=(_h('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}'), 2, False))
@example(case=(_h('{"a":{"dtype":"F6_E3M2","shape":[5],"data_offsets":[0,4]}}'), 4, False))
@example(case=(_h('{"a":{' + E.format("1", 0, 1) + '},"__metadata__":{"k":NaN}}'), 1, False))
@example(case=(_h('{"a\\ud800":{' + E.format("1", 0, 1) + "}}"), 1, False))
@example(case=(_h('{"a":{' + E.format("1e400", 0, 1) + "}}"), 1, False))
@example(case=(_h('{"a":{' + E.format("1", 0, 1) + '},"__metadata__":{},"__metadata__":{}}'), 1, 0))
@example(case=(_h('{"a":{"dtype":"F8_E4M3FNUZ","shape":[2],"data_offsets":[0,2]}}'), 2, False))
def test_both_readers_agree_on_hostile_headers(tmp: Path, case) -> None:
    check_both_ways(tmp, *case, say=note)


@pytest.mark.parametrize("dtype", KNOWN_DTYPES + BOGUS_DTYPES)
def test_the_dtype_table_is_the_installed_librarys(tmp: Path, dtype: str) -> None:
    """A dtype is ours exactly when the installed library reads it, with the same bits: 8
    elements take exactly `bits` bytes, and one byte more or less is refused."""
    bits = DTYPE_BITS.get(dtype, 8)
    for size, fits in ((bits, True), (bits + 1, False), (bits - 1, False)):
        header = f'{{"t":{{"dtype":"{dtype}","shape":[8],"data_offsets":[0,{size}]}}}}'
        check_both_ways(tmp, header.encode(), size, False)
        accepted = isinstance(ours(tmp / "h.safetensors"), ShardHeader)
        assert accepted == (fits and dtype in DTYPE_BITS)


def test_library_problem_reports_a_file_the_library_refuses(tmp: Path) -> None:
    """The production hook (verify's data levels): the library's verdict on a whole file,
    as a Problem with a code, never an exception."""
    good = b'{"a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    path = tmp / "lib.safetensors"
    path.write_bytes(struct.pack("<Q", len(good)) + good + b"xy")
    header = read_header(path)
    assert library_problem(path, header) is None
    path.write_bytes(struct.pack("<Q", len(good)) + good + b"xyz")  # a trailing byte
    problem = library_problem(path, header)
    assert problem is not None and problem.code is Code.HEADER_LIBRARY_REFUSES
    other = header.tensors["a"]._replace(shape=(1, 2))  # our reading, as if it differed
    path.write_bytes(struct.pack("<Q", len(good)) + good + b"xy")
    skewed = ShardHeader(header.file, header.file_size, header.data_start, {"a": other}, {})
    problem = library_problem(path, skewed)
    assert problem is not None and problem.code is Code.HEADER_LIBRARY_REFUSES
    assert problem.tensor == "a"


def test_verify_reports_a_file_the_library_refuses_never_crashes(
    converted: Path, small_source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where verify hands files to the library (--checksums, --numerics), the library's
    refusal is a Problem with a code at that level, never a traceback."""
    from kimi_w31.converter.audit import verify

    def refuse(*args, **kwargs):
        raise safetensors.SafetensorError("Error while deserializing header: refused")

    monkeypatch.setattr(safetensors, "safe_open", refuse)
    report = verify(converted, source=str(small_source), checksums=True, numerics=True, sample=2)
    failed = {
        c.level for c in report.checks for p in c.problems if p.code is Code.HEADER_LIBRARY_REFUSES
    }
    assert failed == {"checksums", "numerics"}
    assert not report.ok
