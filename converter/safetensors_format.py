"""The safetensors file format: parse headers strictly, build headers for writing.

Reading follows the library's own rules, with one error per reason (like safetensors'
`SafeTensorError`): 8-byte little-endian header length, a header of at most 100 MB that is
UTF-8 JSON with no duplicate keys, known dtypes, byte sizes that agree with shapes, and
offsets that tile the data section exactly (sorted, contiguous, no gap, no overlap, no
trailing bytes). Only the header is read; tensor data never is.

The safetensors library has no streaming writer, so `build_header` produces the header
bytes for a list of tensors whose data the executor then streams in order.
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from operator import attrgetter, itemgetter
from typing import NamedTuple

from .errors import Code, Fatal, Problem, fail
from .hashing import sha256_bytes

MAX_HEADER_BYTES = 100_000_000
HEADER_ALIGN = 8

# Bits per element of every dtype safetensors knows (F4/F6 pack below one byte).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}


class TensorInfo(NamedTuple):
    """One tensor as a header describes it; `begin`/`end` are absolute file offsets.

    A NamedTuple, not a frozen dataclass: the real model has ~500k of these and a frozen
    dataclass costs several times more to construct.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class ShardHeader:
    file: str
    file_size: int
    data_start: int
    tensors: dict[str, TensorInfo]  # in offset order: the order the bytes are read in
    metadata: dict[str, str]
    header_sha256: str = ""


_BITS_BY_DTYPE = DTYPE_BITS  # local alias for the hot loop


def tensor_nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    bits = DTYPE_BITS[dtype] * math.prod(shape)
    return (bits + 7) // 8


def _reject_duplicates(pairs: list[tuple[str, object]]) -> dict[str, object]:
    # json keeps the last of duplicate keys silently; a header with two meanings is rejected.
    seen = dict(pairs)
    if len(seen) != len(pairs):
        dup = next(k for i, (k, _) in enumerate(pairs) if any(k == q for q, _ in pairs[:i]))
        raise _DuplicateKey(dup)
    return seen


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def parse_header_bytes(file: str, raw: bytes, file_size: int) -> ShardHeader:
    """Validate a header (the bytes after the 8-byte length) against the file size."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise fail(Code.HEADER_NOT_UTF8, f"header is not UTF-8 ({exc.reason})", file=file) from None
    if not text.lstrip().startswith("{"):
        raise fail(Code.HEADER_NOT_JSON, "header is not a JSON object", file=file)
    data_start = 8 + len(raw)
    parsed = _parse_common_header(text, data_start)
    if parsed is None:  # anything unusual: the strict path finds and words every problem
        parsed = _parse_strict(file, text, data_start)
    tensors, metadata = parsed
    tensors = _check_tiling(file, tensors, data_start, file_size)
    digest = sha256_bytes(raw)
    return ShardHeader(file, file_size, data_start, tensors, metadata, digest)


_new_tuple = tuple.__new__  # builds a TensorInfo without the Python-level __new__ (~3x faster)


def _parse_common_header(
    text: str, data_start: int
) -> tuple[dict[str, TensorInfo], dict[str, str]] | None:
    """The header as every safetensors writer emits it, validated in one lean pass over
    ~500k entries; None at the first thing it does not recognise (then `_parse_strict`).

    Objects are decoded to tuples of (key, value) pairs (a C-level hook): duplicates stay
    visible, and no dict is built per entry. An entry is accepted only with exactly the keys
    dtype, shape, data_offsets in that order, so it cannot hold a duplicate.
    """
    try:
        pairs = json.loads(text, object_pairs_hook=tuple)
    except (ValueError, RecursionError):
        return None
    if type(pairs) is not tuple:
        return None
    bits_of, prod, new, info_cls = _BITS_BY_DTYPE, math.prod, _new_tuple, TensorInfo
    tensors: dict[str, TensorInfo] = {}
    metadata: dict[str, str] = {}
    seen_metadata = False
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    for name, entry in pairs:
        if type(entry) is not tuple or len(entry) != 3 or name == "__metadata__":
            if name != "__metadata__" or seen_metadata or type(entry) is not tuple:
                return None
            seen_metadata = True
            metadata = dict(entry)
            if len(metadata) != len(entry) or not all(
                type(k) is str and type(v) is str for k, v in entry
            ):
                return None
            continue
        (k1, dtype), (k2, shape), (k3, offsets) = entry
        if k1 != "dtype" or k2 != "shape" or k3 != "data_offsets":
            return None
        if type(dtype) is not str or type(shape) is not list or type(offsets) is not list:
            return None
        if len(offsets) != 2:
            return None
        begin, end = offsets
        if type(begin) is not int or type(end) is not int or not 0 <= begin <= end:
            return None
        if len(shape) == 2:
            rows, cols = shape
            if type(rows) is not int or type(cols) is not int or rows < 0 or cols < 0:
                return None
        elif not all(type(d) is int and d >= 0 for d in shape):
            return None
        bits = bits_of.get(dtype)
        if bits is None or end - begin != (bits * prod(shape) + 7) // 8:
            return None
        shape_t = tuple(shape)
        shape_t = shapes.setdefault(shape_t, shape_t)  # a handful of shapes, shared
        tensors[name] = new(info_cls, (name, dtype, shape_t, data_start + begin, data_start + end))
    if len(tensors) + seen_metadata != len(pairs):
        return None  # a tensor name given twice
    return tensors, metadata


def _parse_strict(file: str, text: str, data_start: int) -> tuple[dict[str, TensorInfo], dict]:
    """Every rule checked field by field, with one message per problem found."""
    problems: list[Problem] = []

    def bad(code: Code, what: str, tensor: str | None = None, **kw: str) -> None:
        problems.append(Problem(code, what, file=file, tensor=tensor, **kw))

    try:
        doc = json.loads(text, object_pairs_hook=_reject_duplicates)
    except _DuplicateKey as exc:
        raise fail(
            Code.HEADER_DUPLICATE_KEY, f"header has duplicate key {exc.key!r}", file=file
        ) from None
    except (ValueError, RecursionError) as exc:  # also ints beyond Python's digit limit
        raise fail(Code.HEADER_NOT_JSON, f"header is not valid JSON ({exc})", file=file) from None
    if not isinstance(doc, dict):
        raise fail(Code.HEADER_NOT_JSON, "header is not a JSON object", file=file)

    metadata: dict[str, str] = {}
    raw_meta = doc.pop("__metadata__", None)
    if raw_meta is not None:
        if not isinstance(raw_meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in raw_meta.items()
        ):
            bad(Code.HEADER_METADATA, "__metadata__ must map strings to strings")
        else:
            metadata = raw_meta

    tensors: dict[str, TensorInfo] = {}
    for name, entry in doc.items():
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            bad(Code.HEADER_ENTRY, "entry must have exactly dtype, shape and data_offsets", name)
            continue
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
            bad(
                Code.HEADER_DTYPE,
                "unknown dtype",
                name,
                expected="a safetensors dtype",
                found=repr(dtype),
            )
            continue
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            bad(
                Code.HEADER_SHAPE,
                "shape must be a list of non-negative integers",
                name,
                found=repr(shape),
            )
            continue
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
        ):
            bad(Code.HEADER_OFFSETS, "data_offsets must be two integers", name, found=repr(offsets))
            continue
        begin, end = offsets
        if begin < 0 or end < begin:
            bad(
                Code.HEADER_OFFSETS,
                "data_offsets out of order or negative",
                name,
                found=repr(offsets),
            )
            continue
        want = tensor_nbytes(dtype, shape)
        if end - begin != want:
            bad(
                Code.HEADER_SIZE_MISMATCH,
                "byte size disagrees with dtype and shape",
                name,
                expected=f"{want} bytes for {dtype}{shape}",
                found=f"{end - begin} bytes",
            )
            continue
        tensors[name] = TensorInfo(name, dtype, tuple(shape), data_start + begin, data_start + end)
    if problems:
        raise Fatal(problems)
    return tensors, metadata


_begin = itemgetter(3)
_end = itemgetter(4)


def _check_tiling(
    file: str, tensors: dict[str, TensorInfo], data_start: int, file_size: int
) -> dict[str, TensorInfo]:
    """Offsets must tile [0, data_len) exactly: sorted, contiguous, ending at the file's end.

    Returns the tensors in offset order (the order the bytes are read in).
    """
    infos = list(tensors.values())
    begins, ends = list(map(_begin, infos)), list(map(_end, infos))
    # Common case, compared as whole lists in C: already in offset order and contiguous.
    if not infos and file_size == data_start:
        return tensors
    if infos and begins[0] == data_start and ends[-1] == file_size and begins[1:] == ends[:-1]:
        return tensors
    problems: list[Problem] = []
    ordered = sorted(infos, key=_begin_end)
    cursor = data_start
    for info in ordered:
        if info.begin != cursor:
            overlap = info.begin < cursor
            kind = "overlaps the previous tensor" if overlap else "leaves a gap"
            problems.append(
                Problem(
                    Code.HEADER_OVERLAP if overlap else Code.HEADER_GAP,
                    f"data_offsets {kind}",
                    file=file,
                    tensor=info.name,
                    expected=f"start at {cursor - data_start}",
                    found=str(info.begin - data_start),
                )
            )
        cursor = max(cursor, info.end)
    if cursor != file_size and not problems:
        code, what = (
            (Code.FILE_TRUNCATED, "file is truncated")
            if cursor > file_size
            else (Code.FILE_TRAILING_BYTES, "file has trailing bytes")
        )
        problems.append(
            Problem(code, what, file=file, expected=f"{cursor} bytes", found=f"{file_size} bytes")
        )
    if problems:
        raise Fatal(problems)
    return {info.name: info for info in ordered}


_begin_end = attrgetter("begin", "end")


def read_header(path: str | os.PathLike[str], display_name: str | None = None) -> ShardHeader:
    """Read and validate one shard's header. Never reads tensor data."""
    name = display_name or os.fspath(path)
    raw, file_size = read_header_bytes(path, name)
    return parse_header_bytes(name, raw, file_size)


def read_header_bytes(path: str | os.PathLike[str], name: str) -> tuple[bytes, int]:
    """The header bytes (after the length prefix) and the file size, with the length checks."""
    try:
        with open(path, "rb") as fh:
            file_size = os.fstat(fh.fileno()).st_size
            length = check_header_length(name, fh.read(8), file_size)
            raw = fh.read(length)
    except OSError as exc:
        raise fail(Code.FILE_UNREADABLE, f"cannot read ({exc.strerror})", file=name) from None
    return raw, file_size


def check_header_length(name: str, prefix: bytes, file_size: int) -> int:
    """The header length the 8-byte prefix gives, checked against the limit and the file."""
    if len(prefix) < 8:
        raise fail(
            Code.HEADER_TOO_SMALL,
            "file too small for a safetensors header",
            file=name,
            expected="at least 8 bytes",
            found=f"{file_size} bytes",
        )
    (length,) = struct.unpack("<Q", prefix[:8])
    if length == 0:
        raise fail(Code.HEADER_LENGTH_ZERO, "header length is 0", file=name)
    if length > MAX_HEADER_BYTES:
        raise fail(
            Code.HEADER_TOO_LARGE,
            "header length exceeds the 100 MB limit",
            file=name,
            expected=f"<= {MAX_HEADER_BYTES}",
            found=str(length),
        )
    if 8 + length > file_size:
        raise fail(
            Code.HEADER_BEYOND_FILE,
            "header length is larger than the file",
            file=name,
            expected=f"<= {file_size - 8}",
            found=str(length),
        )
    return length


@dataclass(frozen=True, slots=True)
class HeaderEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def build_header(entries: Sequence[HeaderEntry], metadata: dict[str, str] | None = None) -> bytes:
    """Length prefix + JSON header, space-padded so the data section starts 8-byte aligned.

    Tensors are laid out in the order given, contiguously from offset 0.
    """
    fast = _fast_header_body(entries, metadata)
    if fast is not None:
        return fast
    doc: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for e in entries:
        doc[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [offset, offset + e.nbytes],
        }
        offset += e.nbytes
    body = json.dumps(doc, separators=(",", ":")).encode()
    body += b" " * (-(8 + len(body)) % HEADER_ALIGN)
    return struct.pack("<Q", len(body)) + body


_PLAIN_TEXT = re.compile(r"[A-Za-z0-9_.\-:/]*")


def _fast_header_body(
    entries: Sequence[HeaderEntry], metadata: dict[str, str] | None
) -> bytes | None:
    """The same bytes `json.dumps` would give, formatted directly (5x faster at 500k tensors);
    None when a name would need JSON escaping, so the general path handles it."""
    if metadata:
        return None
    # One regex pass over all names at once (the class has no separator, so joining is safe).
    if not _PLAIN_TEXT.fullmatch("".join(e.name for e in entries)):
        return None
    # ~10 distinct (dtype, shape) pairs serve 500k tensors: format each one once.
    middles: dict[tuple[str, tuple[int, ...]], str] = {}
    parts = ['{"__metadata__":{"format":"pt"}']
    append = parts.append
    offset = 0
    for e in entries:
        middle = middles.get((e.dtype, e.shape))
        if middle is None:
            if not _PLAIN_TEXT.fullmatch(e.dtype):
                return None
            shape = ",".join(map(str, e.shape))
            middle = f'":{{"dtype":"{e.dtype}","shape":[{shape}],"data_offsets":['
            middles[(e.dtype, e.shape)] = middle
        end = offset + e.nbytes
        append(f',"{e.name}{middle}{offset},{end}]}}')
        offset = end
    parts.append("}")
    body = "".join(parts).encode()
    body += b" " * (-(8 + len(body)) % HEADER_ALIGN)
    return struct.pack("<Q", len(body)) + body
