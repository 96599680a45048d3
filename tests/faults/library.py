"""Faults the safetensors library is the judge of, for the fault table and the tests.

- Headers Python's `json` reads and the library (serde_json, usize arithmetic, whole bytes)
  refuses, planted in a source shard: `convert` must refuse each with its reason code,
  naming the shard.
- The same headers planted in a finished output with its checksums re-forged to match:
  `verify --checksums --source SRC --numerics` must report each (exit 1), never pass it
  and never crash.
- E8M0 scales: a 0xFF (NaN) routed-expert scale in a source is refused by a default
  `convert`; finite F32 `*.weight_scale` bytes are never taken for E8M0, even with
  `--check-scales`; a NaN planted in an output (CRC-32 re-forged) is reported by `verify`
  with the same code, at the checksums and numerics levels.
"""

from __future__ import annotations

import json
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

from cli_helpers import json_problems, run_cli
from kimi_w31.converter.reasons import Code
from kimi_w31.converter.safetensors_format import DTYPE_BITS
from verify_mutations import rerecord

from . import core as fl
from .core import CLEAN, CORRECT, CRASH, WRONG, Case
from .data import _plant_nan, names_the_source
from .verify import _output_victim

FAULT_SOURCE = "header the safetensors library refuses (source)"
FAULT_OUTPUT = "header the safetensors library refuses (output, checksums re-forged)"
FAULT_SCALES = "E8M0 scales"
USIZE_MAX = (1 << 64) - 1


def _text_edit(fn: Callable[[dict, str], str]) -> Callable[[Path, str], None]:
    """Rewrite a shard's header as text: fn(header, its JSON) -> new JSON (same data)."""

    def mutate(root: Path, shard: str) -> None:
        header, data = fl.read_shard(root / shard)
        (root / shard).write_bytes(fl.shard_bytes(fn(header, json.dumps(header)), data))

    return mutate


def _first_offset_minus_zero(header: dict, text: str) -> str:
    # The tensor at offset 0: "-0" is 0 to Python's json, a float to the library's.
    first = fl.tensor_names(header)[0]
    header[first]["data_offsets"][0] = "ZERO"
    return json.dumps(header).replace('"ZERO"', "-0")


def _metadata_value(token: str) -> Callable[[dict, str], str]:
    def fn(header: dict, _: str) -> str:
        header["__metadata__"] = {"format": "pt", "x": "VALUE"}
        return json.dumps(header).replace('"VALUE"', token)

    return fn


def _metadata_twice(header: dict, text: str) -> str:
    # Twice whether or not the shard had one (published shards have no __metadata__).
    header.pop("__metadata__", None)
    twice = '"__metadata__": {"format": "pt"}, "__metadata__": {"format": "pt"}'
    return json.dumps(header)[:-1] + ", " + twice + "}"


def _new_tensor(dtype: str, shape: str, nbytes: int) -> Callable[[Path, str], None]:
    """A tensor appended to the shard (and listed in the index), its shape written as
    `shape`: every other rule holds, so only the library's own rules can refuse it."""

    def mutate(root: Path, shard: str) -> None:
        header, data = fl.read_shard(root / shard)
        span = [len(data), len(data) + nbytes]
        header[EXTRA] = {"dtype": dtype, "shape": ["SHAPE"], "data_offsets": span}
        text = json.dumps(header).replace('["SHAPE"]', shape)
        (root / shard).write_bytes(fl.shard_bytes(text, data + b"\x07" * nbytes))
        index = json.loads((root / fl.INDEX).read_text())
        index["weight_map"][EXTRA] = shard
        index["metadata"]["total_size"] += nbytes
        (root / fl.INDEX).write_text(json.dumps(index))

    return mutate


# A library older than 0.6 has no F4: there the same header is an unknown dtype.
SUB_BYTE = Code.HEADER_SUB_BYTE if "F4" in DTYPE_BITS else Code.HEADER_DTYPE

EXTRA = "language_model.model.extra_buffer"
C = Code
# Each header the library refuses, and the one reason our reader must give. The first five
# were accepted by a reader that trusted Python's json, in convert and in verify.
LIBRARY_HEADER_CASES: dict[str, tuple[Callable[[Path, str], None], Code]] = {
    "offset written -0": (_text_edit(_first_offset_minus_zero), C.HEADER_OFFSETS),
    "lone surrogate escape in __metadata__": (
        _text_edit(_metadata_value('"pt\\ud800"')),
        C.HEADER_NOT_JSON,
    ),
    "empty tensor whose dimension product overflows before its zero": (
        _new_tensor("U8", f"[{1 << 32}, {1 << 32}, 0]", 0),
        C.HEADER_OVERFLOW,
    ),
    "empty tensor with a dimension beyond 2^64 - 1": (
        _new_tensor("BF16", f"[0, {USIZE_MAX + 1}]", 0),
        C.HEADER_SHAPE,
    ),
    "F4 tensor whose elements do not fill whole bytes": (_new_tensor("F4", "[5]", 3), SUB_BYTE),
    "size in bits overflows a usize": (_new_tensor("F64", f"[{1 << 61}]", 0), C.HEADER_OVERFLOW),
    "dimension 1e400": (_new_tensor("U8", "[1e400]", 1), C.HEADER_SHAPE),
    "dimension with an exponent": (_new_tensor("U8", "[1e0]", 1), C.HEADER_SHAPE),
    "NaN in __metadata__": (_text_edit(_metadata_value("NaN")), C.HEADER_NOT_JSON),
    "Infinity in __metadata__": (_text_edit(_metadata_value("-Infinity")), C.HEADER_NOT_JSON),
    "__metadata__ given twice": (_text_edit(_metadata_twice), C.HEADER_DUPLICATE_KEY),
}


def source_header_cases(template: Path, work: Path) -> list[Case]:
    cases = {
        name: ((lambda f: lambda src: f(src, fl.VICTIM))(fn), code)
        for name, (fn, code) in LIBRARY_HEADER_CASES.items()
    }
    return fl.hostile_cases(template, work, FAULT_SOURCE, cases, name_file=fl.VICTIM)


def output_header_cases(template: Path, work: Path) -> list[Case]:
    """Each header planted in a finished output, checksums re-forged to match it."""
    src = fl.copy_source(template, work / "src")
    ref = work / "ref"
    fl.reference_output(src, ref)
    victim = _output_victim(ref)
    rows = []
    for i, (name, (fn, want)) in enumerate(LIBRARY_HEADER_CASES.items()):
        out = work / f"o{i}"
        shutil.copytree(ref, out)
        fn(out, victim)
        rerecord(out)  # what a tamperer (or a careless tool) would do
        args = ["verify", out, "--checksums", "--source", src, "--numerics", "--json"]
        run = run_cli(args, inprocess=True)
        code, text, exc = run.returncode, run.stdout, run.exception
        found = fl.codes(text)
        if exc is not None or fl.looks_like_crash(text):
            outcome, detail = CRASH, f"{type(exc).__name__ if exc else 'traceback'}"
        elif code != 1 or want.value not in found:
            outcome, detail = WRONG, f"exit {code}, codes {sorted(c for c in found if c)}"
        else:
            outcome, detail = CLEAN, want.value
        rows.append(Case(FAULT_OUTPUT, name, outcome, detail))
        shutil.rmtree(out, ignore_errors=True)
    return rows


def _add_tensor(src: Path, shard: str, name: str, dtype: str, shape: list[int], data: bytes):
    """A tensor appended to a source shard, and to the index."""
    header, old = fl.read_shard(src / shard)
    header[name] = {
        "dtype": dtype,
        "shape": shape,
        "data_offsets": [len(old), len(old) + len(data)],
    }
    (src / shard).write_bytes(fl.shard_bytes(header, old + data))
    index = json.loads((src / fl.INDEX).read_text())
    index["weight_map"][name] = shard
    index["metadata"]["total_size"] += len(data)
    (src / fl.INDEX).write_text(json.dumps(index))


def scale_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    # 1. A NaN routed-expert scale in a source: a default convert refuses it.
    src = fl.copy_source(template, work / "nan-src")
    victim = next(
        p
        for p in sorted(src.glob("*.safetensors"))
        if any(".w1.weight_scale" in t for t in fl.tensor_names(fl.read_shard(p)[0]))
    )
    tensor, pos = _plant_nan(victim)
    out = work / "nan-out"
    proc = run_cli([*fl.convert_args(src, out), "--json"])
    hits = [p for p in json_problems(proc.stdout) if names_the_source(p, victim.name, tensor, pos)]
    good = proc.returncode == 1 and hits and not (out / fl.INDEX).exists()
    outcome = CRASH if fl.looks_like_crash(proc.stderr) else CLEAN if good else WRONG
    detail = hits[0]["what"][:160] if hits else proc.stdout[-200:]
    rows.append(
        Case(FAULT_SCALES, "NaN expert scale in a source, default convert", outcome, detail)
    )

    # 2. Finite F32 scales whose bytes hold 0xFF: never E8M0, even with --check-scales.
    src = fl.copy_source(template, work / "f32-src")
    # ~1.00003, -2.00006, 0.50002, 3.00009: finite floats, each with a 0xFF byte.
    values = struct.pack("<4I", 0x3F8000FF, 0xC00000FF, 0x3F0000FF, 0x404000FF)
    _add_tensor(src, fl.VICTIM, "language_model.model.norm.weight_scale", "F32", [4], values)
    out = work / "f32-out"
    proc = run_cli([*fl.convert_args(src, out, "--check-scales"), "--json"])
    ver = run_cli(["verify", out, "--checksums", "--source", src, "--numerics", "--json"])
    good = proc.returncode == 0 and ver.returncode == 0
    crashed = fl.looks_like_crash(proc.stderr + ver.stderr)
    rows.append(
        Case(
            FAULT_SCALES,
            "finite F32 *.weight_scale with 0xFF bytes, --check-scales, then verify",
            CRASH if crashed else CORRECT if good else WRONG,
            ""
            if good
            else f"convert {proc.returncode} verify {ver.returncode}: "
            f"{sorted(fl.codes(proc.stdout) | fl.codes(ver.stdout))}",
        )
    )

    # 3. A NaN planted in an output's expert scale, its CRC-32 re-recorded: verify reports it
    # with the code convert uses, where it reads the data (checksums, numerics).
    src = fl.copy_source(template, work / "planted-src")
    out = work / "planted-out"
    fl.reference_output(src, out)
    shard = next(
        p
        for p in sorted(out.glob("*.safetensors"))
        if any(".w31.weight_scale" in t for t in fl.tensor_names(fl.read_shard(p)[0]))
    )
    header, data = fl.read_shard(shard)
    name = next(t for t in fl.tensor_names(header) if ".w31.weight_scale" in t)
    begin = header[name]["data_offsets"][0]
    shard.write_bytes(fl.shard_bytes(header, data[:begin] + b"\xff" + data[begin + 1 :]))
    rerecord(out)
    for level, args in (
        ("checksums", ["--checksums"]),
        ("numerics", ["--source", src, "--numerics", "--all"]),
    ):
        run = run_cli(["verify", out, *args, "--json"], inprocess=True)
        code, text, exc = run.returncode, run.stdout, run.exception
        checks = _checks_with(text, Code.SCALE_NAN.value, name)
        good = code == 1 and level in checks
        crashed = exc is not None or fl.looks_like_crash(text)
        rows.append(
            Case(
                FAULT_SCALES,
                f"NaN planted in an output scale (CRC re-forged): verify --{level}",
                CRASH if crashed else CLEAN if good else WRONG,
                f"reported at {sorted(checks)}" if good else text[-200:],
            )
        )
    return rows


def _checks_with(text: str, code: str, tensor: str) -> set[str]:
    """The verify levels whose problems include `code` for `tensor` (from --json)."""
    try:
        checks = json.loads(text)["checks"]
    except (ValueError, KeyError):
        return set()
    return {
        c.get("level")
        for c in checks
        for p in c.get("problems", [])
        if p.get("code") == code and p.get("tensor") == tensor
    }


def library_cases(template: Path, work: Path) -> list[Case]:
    return (
        source_header_cases(template, work / "source")
        + output_header_cases(template, work / "output")
        + scale_cases(template, work / "scales")
    )
