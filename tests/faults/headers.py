"""Hostile safetensors headers: each malformed shard, and headers past the library's limit."""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Callable
from pathlib import Path

from cli_helpers import run_cli
from kimi_w31.converter.reasons import Code

from .core import (
    CORRECT,
    CRASH,
    INDEX,
    MANIFEST,
    VICTIM,
    WRONG,
    C,
    Case,
    copy_source,
    hostile_cases,
    looks_like_crash,
    read_shard,
    shard_bytes,
    tensor_names,
)


def _edit(fn: Callable[[dict, bytes], tuple[dict | bytes | str, bytes]]):
    def mutate(path: Path) -> None:
        header, data = read_shard(path)
        new_header, new_data = fn(header, data)
        path.write_bytes(shard_bytes(new_header, new_data))

    return mutate


def _entry(fn: Callable[[dict, list[str]], None]):
    def edit(header: dict, data: bytes):
        fn(header, tensor_names(header))
        return header, data

    return _edit(edit)


def _raw(fn: Callable[[bytes], bytes]):
    def mutate(path: Path) -> None:
        path.write_bytes(fn(path.read_bytes()))

    return mutate


def _dup_key(header: dict, data: bytes):
    first = tensor_names(header)[0]
    text = json.dumps(header)
    dup = json.dumps({first: header[first]})[1:-1]
    return text[:-1] + ", " + dup + "}", data


def _dup_inner_key(header: dict, data: bytes):
    first = tensor_names(header)[0]
    text = json.dumps(header)
    old = json.dumps({first: header[first]})[1:-1]
    inner = json.dumps(header[first])
    new = f'"{first}": ' + inner[:-1] + ', "dtype": "U8"}'
    return text.replace(old, new, 1), data


def _set(key: str, value):
    def fn(header: dict, names: list[str]) -> None:
        header[names[1]][key] = value

    return fn


def _overlap(header: dict, names: list[str]) -> None:
    a, b = header[names[1]]["data_offsets"]
    header[names[1]]["data_offsets"] = [a - 8, b - 8]


def _gap(header: dict, data: bytes):
    # Move the last tensor 8 bytes further, keeping the file size: a gap, then a truncation.
    last = tensor_names(header)[-1]
    a, b = header[last]["data_offsets"]
    header[last]["data_offsets"] = [a + 8, b + 8]
    return header, data + b"\0" * 8


def _extra_tensor(header: dict, data: bytes):
    end = max(v["data_offsets"][1] for k, v in header.items() if k != "__metadata__")
    header["not.in.the.index"] = {"dtype": "U8", "shape": [8], "data_offsets": [end, end + 8]}
    return header, data + b"\1" * 8


def _meta(value):
    def edit(header: dict, data: bytes):
        header["__metadata__"] = value
        return header, data

    return _edit(edit)


def _huge_int(header: dict, data: bytes):
    header[tensor_names(header)[1]]["shape"] = ["HUGE"]
    return json.dumps(header).replace('"HUGE"', "9" * 5000), data


def _random_bytes(_: bytes) -> bytes:
    return random.Random(7).randbytes(4096)


# Each hostile shard, and the one reason it must be refused for (the file is always named).
HEADER_CASES: dict[str, tuple[Callable[[Path], None], Code]] = {
    "random bytes": (_raw(_random_bytes), C.HEADER_TOO_LARGE),
    "file shorter than 8 bytes": (_raw(lambda b: b[:5]), C.HEADER_TOO_SMALL),
    "truncated inside the header": (_raw(lambda b: b[:200]), C.HEADER_BEYOND_FILE),
    "truncated inside the data": (_raw(lambda b: b[: len(b) - 1000]), C.FILE_TRUNCATED),
    "header length 0": (_raw(lambda b: struct.pack("<Q", 0) + b[8:]), C.HEADER_LENGTH_ZERO),
    "header length larger than the file": (
        _raw(lambda b: struct.pack("<Q", len(b)) + b[8:]),
        C.HEADER_BEYOND_FILE,
    ),
    "header length over 100 MB": (
        _raw(lambda b: struct.pack("<Q", 200_000_000) + b[8:]),
        C.HEADER_TOO_LARGE,
    ),
    "non-UTF-8 header": (_raw(lambda b: b[:8] + b"{\xff\xfe" + b[11:]), C.HEADER_NOT_UTF8),
    "invalid JSON": (_raw(lambda b: b[:8] + b"{{" + b[10:]), C.HEADER_NOT_JSON),
    "header is a JSON array": (
        _edit(lambda h, d: ("[" + " " * (len(json.dumps(h)) - 2) + "]", d)),
        C.HEADER_NOT_JSON,
    ),
    "duplicate tensor key": (_edit(_dup_key), C.HEADER_DUPLICATE_KEY),
    "duplicate key inside an entry": (_edit(_dup_inner_key), C.HEADER_DUPLICATE_KEY),
    "unknown dtype": (_entry(_set("dtype", "Q7")), C.HEADER_DTYPE),
    "shape disagrees with offsets": (
        _entry(lambda h, n: h[n[1]].update(shape=[3, 5])),
        C.HEADER_SIZE_MISMATCH,
    ),
    "negative dimension": (_entry(_set("shape", [-1, 8])), C.HEADER_SHAPE),
    "overlapping offsets": (_entry(_overlap), C.HEADER_OVERLAP),
    "out-of-order offsets (end < begin)": (
        _entry(lambda h, n: h[n[1]].update(data_offsets=h[n[1]]["data_offsets"][::-1])),
        C.HEADER_OFFSETS,
    ),
    "negative offsets": (
        _entry(lambda h, n: h[n[0]].update(data_offsets=[-8, 0])),
        C.HEADER_OFFSETS,
    ),
    "non-integer offsets (float)": (
        _entry(
            lambda h, n: h[n[1]].update(data_offsets=[float(x) for x in h[n[1]]["data_offsets"]])
        ),
        C.HEADER_OFFSETS,
    ),
    "non-integer offsets (string)": (
        _entry(lambda h, n: h[n[1]].update(data_offsets=[str(x) for x in h[n[1]]["data_offsets"]])),
        C.HEADER_OFFSETS,
    ),
    "boolean offsets": (_entry(_set("data_offsets", [False, True])), C.HEADER_OFFSETS),
    "out-of-range offsets": (
        _entry(lambda h, n: h[n[-1]].update(data_offsets=[h[n[-1]]["data_offsets"][0], 1 << 40])),
        C.HEADER_SIZE_MISMATCH,
    ),
    "gap between tensors": (_edit(_gap), C.HEADER_GAP),
    "trailing bytes": (_raw(lambda b: b + b"\0" * 16), C.FILE_TRAILING_BYTES),
    "__metadata__ with a non-string value": (_meta({"format": "pt", "step": 3}), C.HEADER_METADATA),
    "__metadata__ not an object": (_meta(["pt"]), C.HEADER_METADATA),
    "entry with an extra key": (_entry(_set("extra", 1)), C.HEADER_ENTRY),
    "integer beyond Python's digit limit": (_edit(_huge_int), C.HEADER_NOT_JSON),
    "deeply nested JSON": (
        _raw(lambda b: shard_bytes('{"x":' + "[" * 100_000 + "]" * 100_000 + "}", b"")),
        C.HEADER_NOT_JSON,
    ),
    "tensor the index does not list": (_edit(_extra_tensor), C.INDEX_TENSOR_MISSING),
}


def header_cases(template: Path, work: Path) -> list[Case]:
    # Everything a header fault reports names the shard it is in.
    cases = {name: (_on_victim(fn), code) for name, (fn, code) in HEADER_CASES.items()}
    return hostile_cases(template, work, "hostile safetensors header", cases, name_file=VICTIM)


def _on_victim(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda src: fn(src / VICTIM)


# ------------------------------------------------------------ headers past the library limit


def header_bound_cases(template: Path, work: Path) -> list[Case]:
    """A source of two shards whose many tiny tensors give headers of ~60 MB each: packed by
    data size alone, one output shard would carry a ~120 MB header that the safetensors
    library refuses to open. Every output shard must open with the library."""
    from kimi_w31.converter.synth import write_safetensors
    from safetensors import safe_open

    src = copy_source(template, work / "src")
    index = json.loads((src / INDEX).read_text())
    tiny = b"\x00"
    for n in range(2):
        name = f"extra-{n + 1}.safetensors"
        tensors = [
            (f"model.tiny.{n}.{i:07d}." + "x" * 80, "U8", (1,), tiny) for i in range(480_000)
        ]
        write_safetensors(src / name, tensors)
        index["weight_map"].update({t[0]: name for t in tensors})
    (src / INDEX).write_text(json.dumps(index))
    out = work / "out"
    proc = run_cli([src, out, *MANIFEST, "-q", "--json"], timeout=600)
    if proc.returncode != 0:
        return [
            Case(
                "output header size",
                "~120 MB of headers in a source",
                CRASH if looks_like_crash(proc.stderr) else WRONG,
                proc.stdout[-200:],
            )
        ]
    shards = sorted(out.glob("*.safetensors"))
    sizes = []
    for path in shards:
        with open(path, "rb") as fh:
            sizes.append(struct.unpack("<Q", fh.read(8))[0])
        with safe_open(str(path), framework="np") as fh:  # the library's own limit
            fh.keys()
    ok = len(shards) > 1 and max(sizes) <= 100_000_000
    return [
        Case(
            "output header size",
            "~120 MB of headers in a source",
            CORRECT if ok else WRONG,
            f"{len(shards)} shards, largest header {max(sizes) / 1e6:.1f} MB",
        )
    ]
