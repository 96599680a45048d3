"""Shared fault-injection helpers for the `test_fault_*` suites and `tools/fault_table.py`.

Every scenario here runs the real converter (in-process through click's runner for input
validation, in a subprocess wherever a process must die or hit a resource limit) and
classifies each case by what a user would see:

- `clean error`: exit 1 (or 2 for usage), the expected reason code in `--json` with the
  file named, no traceback, no index in the output, nothing written outside the output
  directory;
- `resumed identical`: after the fault, rerunning the same command produced an output
  byte-identical to an uninterrupted run;
- `correct`: a case that must simply work (a Hub cache source, permissions, --force);
- `crash`: a traceback or an unexpected exception surfaced;
- `silently wrong`: exit 0 on bad input, or an output that differs from the reference.

Scenarios return `Case` rows; the tests assert on them and the fault table prints them.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import shutil
import signal
import struct
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from click.testing import CliRunner
from kimi_w31.converter.errors import Code
from kimi_w31.converter.outdir import STATE_DIR, OutputDir
from kimi_w31.converter.pipeline import ConvertOptions, prepare
from kimi_w31.converter.synth import SynthSpec, synth_checkpoint

from kimi_w31.cli import main as cli_main

CLEAN = "clean error"
RESUMED = "resumed identical"
CORRECT = "correct"
CRASH = "crash"
WRONG = "silently wrong"

MANIFEST = ["--manifest", "kimi-k3-any"]
SHARD_SIZE = ["--max-shard-size", "300KB"]  # ~11 output shards from the small synth source
INDEX = "model.safetensors.index.json"
STATE = STATE_DIR
VICTIM = "model-00002-of-00004.safetensors"  # the source shard the data faults hit


@dataclass
class Case:
    fault: str  # the fault class (a row group of the table)
    name: str
    outcome: str
    detail: str = ""


# ---------------------------------------------------------------------------- sources


def make_source(path: Path, layers: int = 3, experts: int = 8, shards: int = 4) -> Path:
    synth_checkpoint(path, SynthSpec(layers=layers, experts=experts, shards=shards))
    return path


def copy_source(template: Path, dest: Path) -> Path:
    shutil.copytree(template, dest, symlinks=True)
    return dest


def tree(root: Path) -> dict[str, str]:
    """Relative path -> sha256 (or link target) of everything under root, hidden files too."""
    out: dict[str, str] = {}
    if not root.exists():
        return out
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "-> " + os.readlink(p)
            elif p.is_file():
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            else:
                out[rel] = "dir"
    return out


def tree_diff(a: dict[str, str], b: dict[str, str]) -> str:
    keys = sorted(set(a) | set(b))
    diff = [k for k in keys if a.get(k) != b.get(k)]
    return ", ".join(diff[:5]) + (f" (+{len(diff) - 5})" if len(diff) > 5 else "")


# ---------------------------------------------------------------------- running the CLI


def cli_cmd() -> list[str]:
    return [sys.executable, "-m", "kimi_w31"]


def run_cli(
    args: list[str],
    env: dict[str, str] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_W31_")}
    full_env.update(env or {})
    full_env["COLUMNS"] = "200"  # one problem a line, whatever the terminal
    return subprocess.run(
        cli_cmd() + [str(a) for a in args],
        env=full_env,
        preexec_fn=preexec_fn,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def convert_args(src: Path, out: Path, *extra: str) -> list[str]:
    return [str(src), str(out), *MANIFEST, *SHARD_SIZE, "-q", *extra]


def run_inprocess(args: list[str]) -> tuple[int, str, BaseException | None]:
    """The CLI in this process (fast, for validation cases); (exit code, stdout, exception)."""
    result = CliRunner().invoke(cli_main, [str(a) for a in args], env={"COLUMNS": "200"})
    exc = result.exception if not isinstance(result.exception, SystemExit) else None
    return result.exit_code, result.stdout, exc


def json_problems(text: str) -> list[dict]:
    """The problems a `--json` run reported (empty if it printed no JSON report)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    if not isinstance(doc, dict):
        return []
    found = list(doc.get("problems") or [])
    for check in doc.get("checks") or []:  # verify's report
        found += check.get("problems") or []
    return found


def _first_problem(text: str) -> str:
    problems = json_problems(text)
    if not problems:
        return text[-160:]
    return f"[{problems[0].get('code')}] {problems[0].get('what', '')}"[:160]


def codes(text: str) -> set[str]:
    return {p.get("code") for p in json_problems(text)}


def looks_like_crash(text: str) -> bool:
    # The CLI's last-resort handler prints this for an unexpected exception.
    return "Traceback (most recent call last)" in text or "KIMI_W31_DEBUG" in text


def classify_error(
    code: int,
    text: str,
    exc: BaseException | None,
    out: Path,
    outside_before: dict[str, str],
    outside_after: dict[str, str],
    want: Code | None = None,
    must_name: str | None = None,
) -> tuple[str, str]:
    """A case that must be refused (run with --json): is it a clean error with its code?"""
    flat = " ".join(text.split())
    if exc is not None or looks_like_crash(text):
        return CRASH, f"{type(exc).__name__ if exc else 'traceback'}: {flat[-300:]}"
    if code == 0:
        return WRONG, "exit 0 on hostile input"
    if (out / INDEX).exists():
        return WRONG, "an index (complete-looking output) was written"
    if outside_before != outside_after:
        return WRONG, "wrote outside the output directory: " + tree_diff(
            outside_before, outside_after
        )
    problems = json_problems(text)
    if code not in (1, 2) or not problems:
        return CRASH, f"exit {code} without a reported problem: {flat[-300:]}"
    if want is not None and want.value not in {p.get("code") for p in problems}:
        return CRASH, f"reason {want.value} not reported: {flat[-300:]}"
    if must_name and not any(must_name in (p.get("file") or "") for p in problems):
        return CRASH, f"no problem names {must_name!r}: {flat[-300:]}"
    first = next(p for p in problems if want is None or p.get("code") == want.value)
    return CLEAN, f"[{first.get('code')}] {first.get('what', '')}"[:160]


# -------------------------------------------------------------- hostile safetensors files


def read_shard(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def shard_bytes(header: dict | bytes | str, data: bytes, length: int | None = None) -> bytes:
    body = (
        header
        if isinstance(header, bytes)
        else (header.encode() if isinstance(header, str) else json.dumps(header).encode())
    )
    return struct.pack("<Q", len(body) if length is None else length) + body + data


def _tensors(header: dict) -> list[str]:
    """Tensor names in data order."""
    names = [k for k in header if k != "__metadata__"]
    return sorted(names, key=lambda k: header[k]["data_offsets"][0])


def _edit(fn: Callable[[dict, bytes], tuple[dict | bytes | str, bytes]]):
    def mutate(path: Path) -> None:
        header, data = read_shard(path)
        new_header, new_data = fn(header, data)
        path.write_bytes(shard_bytes(new_header, new_data))

    return mutate


def _entry(fn: Callable[[dict, list[str]], None]):
    def edit(header: dict, data: bytes):
        fn(header, _tensors(header))
        return header, data

    return _edit(edit)


def _raw(fn: Callable[[bytes], bytes]):
    def mutate(path: Path) -> None:
        path.write_bytes(fn(path.read_bytes()))

    return mutate


def _dup_key(header: dict, data: bytes):
    first = _tensors(header)[0]
    text = json.dumps(header)
    dup = json.dumps({first: header[first]})[1:-1]
    return text[:-1] + ", " + dup + "}", data


def _dup_inner_key(header: dict, data: bytes):
    first = _tensors(header)[0]
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
    last = _tensors(header)[-1]
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
    header[_tensors(header)[1]]["shape"] = ["HUGE"]
    return json.dumps(header).replace('"HUGE"', "9" * 5000), data


def _random_bytes(_: bytes) -> bytes:
    return random.Random(7).randbytes(4096)


C = Code
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


# ------------------------------------------------------------ hostile index / source tree


def _index_edit(fn: Callable[[dict], None]):
    def mutate(src: Path) -> None:
        index = json.loads((src / INDEX).read_text())
        fn(index)
        (src / INDEX).write_text(json.dumps(index))

    return mutate


def _first_tensor(index: dict, shard: str = VICTIM) -> str:
    return next(t for t, f in index["weight_map"].items() if f == shard)


def _map_first(value):
    def fn(index: dict) -> None:
        index["weight_map"][_first_tensor(index)] = value

    return fn


def _map_all(value):
    def fn(index: dict) -> None:
        for t, f in index["weight_map"].items():
            if f == VICTIM:
                index["weight_map"][t] = value

    return fn


def _symlink_shard_outside(src: Path) -> None:
    """A shard may link anywhere (shards spread over disks), but only to a regular file."""
    outside = src.parent / "outside.safetensors"
    outside.unlink(missing_ok=True)
    os.mkfifo(outside)
    (src / VICTIM).unlink()
    (src / VICTIM).symlink_to(outside)


def _symlink_extra_outside(src: Path) -> None:
    secret = src.parent / "secret.txt"
    secret.write_text("private key material\n")
    (src / "tokenizer.json").unlink()
    (src / "tokenizer.json").symlink_to(secret)


def _shard_is_dir(src: Path) -> None:
    (src / VICTIM).unlink()
    (src / VICTIM).mkdir()


def _shard_is_fifo(src: Path) -> None:
    (src / VICTIM).unlink()
    os.mkfifo(src / VICTIM)


def _move_tensor(index: dict) -> None:
    index["weight_map"][_first_tensor(index)] = "model-00001-of-00004.safetensors"


def _drop_tensor(index: dict) -> None:
    del index["weight_map"][_first_tensor(index)]


def _phantom_tensor(index: dict) -> None:
    index["weight_map"]["phantom.weight"] = VICTIM


def _write(name: str, text: str | bytes):
    def mutate(src: Path) -> None:
        data = text.encode() if isinstance(text, str) else text
        (src / name).write_bytes(data)

    return mutate


def _config_edit(fn: Callable[[dict], None]):
    def mutate(src: Path) -> None:
        config = json.loads((src / "config.json").read_text())
        fn(config)
        (src / "config.json").write_text(json.dumps(config))

    return mutate


INDEX_CASES: dict[str, tuple[Callable[[Path], None], Code]] = {
    "weight_map entry absolute": (
        _index_edit(_map_all("/etc/passwd.safetensors")),
        C.WEIGHT_MAP_ENTRY_UNSAFE,
    ),
    "weight_map entry with ..": (
        _index_edit(_map_all("../outside/" + VICTIM)),
        C.WEIGHT_MAP_ENTRY_UNSAFE,
    ),
    "weight_map entry not .safetensors": (
        _index_edit(_map_all("config.json")),
        C.WEIGHT_MAP_ENTRY_UNSAFE,
    ),
    "weight_map entry not a string": (_index_edit(_map_first(17)), C.WEIGHT_MAP_ENTRY_UNSAFE),
    "weight_map entry empty": (_index_edit(_map_first("")), C.WEIGHT_MAP_ENTRY_UNSAFE),
    "weight_map entry with a NUL byte": (
        _index_edit(_map_first("a\x00.safetensors")),
        C.WEIGHT_MAP_ENTRY_UNSAFE,
    ),
    "shard symlink to a FIFO outside the source": (_symlink_shard_outside, C.NOT_A_REGULAR_FILE),
    "extra file symlink escaping the source": (_symlink_extra_outside, C.LINK_ESCAPES),
    "shard named in the index missing": (lambda src: (src / VICTIM).unlink(), C.SHARD_MISSING),
    "shard is a directory": (_shard_is_dir, C.NOT_A_REGULAR_FILE),
    "shard is a FIFO": (_shard_is_fifo, C.NOT_A_REGULAR_FILE),
    "tensor in a different shard than the index says": (
        _index_edit(_move_tensor),
        C.INDEX_WRONG_SHARD,
    ),
    "tensor missing from the index": (_index_edit(_drop_tensor), C.INDEX_TENSOR_MISSING),
    "index names a tensor the shard lacks": (
        _index_edit(_phantom_tensor),
        C.INDEX_TENSOR_NOT_IN_SHARD,
    ),
    "weight_map not an object": (
        _index_edit(lambda i: i.update(weight_map=["a"])),
        C.INDEX_INVALID,
    ),
    "index not JSON": (_write(INDEX, "{not json"), C.JSON_INVALID),
    "index not UTF-8": (_write(INDEX, b'{"weight_map": "\xff"}'), C.JSON_INVALID),
    "index with a 5000-digit number": (
        _write(INDEX, '{"weight_map": {"a": ' + "9" * 5000 + "}}"),
        C.JSON_INVALID,
    ),
    "config not JSON": (_write("config.json", "]"), C.JSON_INVALID),
    "config deeply nested": (_write("config.json", "[" * 100_000 + "]" * 100_000), C.JSON_INVALID),
    "config not an object": (_write("config.json", "[]"), C.JSON_INVALID),
}


def _expert(config_key: str, fn: Callable[[dict, str], None]):
    """Edit the header of the shard holding the first tensor whose name contains `key`."""

    def mutate(src: Path) -> None:
        index = json.loads((src / INDEX).read_text())
        tensor = next(t for t in index["weight_map"] if config_key in t)
        path = src / index["weight_map"][tensor]
        header, data = read_shard(path)
        fn(header, tensor)
        path.write_bytes(shard_bytes(header, data))

    return mutate


def _reshape(header: dict, tensor: str) -> None:
    # Same byte count, wrong shape: only the manifest can tell.
    rows, cols = header[tensor]["shape"]
    header[tensor]["shape"] = [rows * 2, cols // 2]


def _retype(header: dict, tensor: str) -> None:
    header[tensor].update(dtype="I8")


def _rename_index(old_part: str, new_part: str) -> Callable[[Path], None]:
    """Rename every tensor containing old_part, in the header and in the index."""

    def mutate(src: Path) -> None:
        index = json.loads((src / INDEX).read_text())
        renamed = {}
        for t, f in list(index["weight_map"].items()):
            if old_part in t:
                path = src / f
                header, data = read_shard(path)
                new = t.replace(old_part, new_part)
                header[new] = header.pop(t)
                path.write_bytes(shard_bytes(header, data))
                renamed[t] = new
        index["weight_map"] = {renamed.get(t, t): f for t, f in index["weight_map"].items()}
        (src / INDEX).write_text(json.dumps(index))

    return mutate


def _chain(*fns: Callable[[Path], None]) -> Callable[[Path], None]:
    def mutate(src: Path) -> None:
        for fn in fns:
            fn(src)

    return mutate


def _drop_partner(src: Path) -> None:
    """Rename one w3 to a non-expert name: its w1 then has no partner."""
    _rename_index(".mlp.experts.1.w3.weight_packed", ".mlp.experts.1.w9.weight_packed")(src)


def _wrap_quantization(config: dict) -> None:
    config["quantization_config"] = {
        "quant_method": "kimi_w31",
        "base": config["quantization_config"],
    }


PLAN_CASES: dict[str, tuple[Callable[[Path], None], Code]] = {
    "wrong expert shape": (_expert(".experts.3.w1.weight_packed", _reshape), C.EXPERT_SHAPE),
    "wrong expert dtype": (_expert(".experts.3.w2.weight_scale", _retype), C.EXPERT_DTYPE),
    "w3 partner missing": (_drop_partner, C.EXPERT_PARTNER_MISSING),
    "expert id beyond num_experts": (
        _rename_index(".experts.7.", ".experts.9."),
        C.EXPERT_ID_RANGE,
    ),
    "a layer misses an expert": (
        _rename_index("layers.1.mlp.experts.5.", "layers.1.mlp.xperts.5."),
        C.LAYER_INCOMPLETE,
    ),
    "no quantization_config": (
        _config_edit(lambda c: c.pop("quantization_config")),
        C.NO_QUANTIZATION_CONFIG,
    ),
    "hidden_act is not situ": (
        _config_edit(lambda c: c["text_config"].update(hidden_act="silu")),
        C.SITU_MISMATCH,
    ),
    "SiTU beta disagrees with the manifest": (
        _config_edit(lambda c: c["text_config"].update(activation_situ_beta=5.0)),
        C.SITU_MISMATCH,
    ),
    # -- missing structure: the MoE-layer rule over num_hidden_layers
    "a whole MoE layer without experts (index and headers agree)": (
        _rename_index("layers.2.mlp.experts.", "layers.2.mlp.xperts."),
        C.LAYER_MISSING,
    ),
    "experts under a layer beyond num_hidden_layers": (
        _rename_index("layers.2.mlp.experts.", "layers.7.mlp.experts."),
        C.LAYER_UNEXPECTED,
    ),
    "experts in a dense layer (first_k_dense_replace)": (
        _config_edit(lambda c: c["text_config"].update(first_k_dense_replace=2)),
        C.LAYER_UNEXPECTED,
    ),
    "experts off the moe_layer_freq cadence": (
        _config_edit(lambda c: c["text_config"].update(moe_layer_freq=2)),
        C.LAYER_UNEXPECTED,
    ),
    "routed experts named gate_proj/up_proj/down_proj": (
        _chain(
            _rename_index(".w1.weight_", ".gate_proj.weight_"),
            _rename_index(".w3.weight_", ".up_proj.weight_"),
            _rename_index(".w2.weight_", ".down_proj.weight_"),
        ),
        C.NO_EXPERTS,
    ),
    # -- names the grammar must refuse as a whole
    "expert name with a trailing newline": (
        _rename_index(
            "layers.1.mlp.experts.4.w1.weight_packed", "layers.1.mlp.experts.4.w1.weight_packed\n"
        ),
        C.EXPERT_NAME,
    ),
    "expert id with a leading zero": (_rename_index(".experts.6.", ".experts.06."), C.EXPERT_NAME),
    "expert id in look-alike digits": (
        _rename_index(".experts.6.", ".experts.\u0666."),
        C.EXPERT_NAME,
    ),
    "fused w31 already in the source": (
        _rename_index(".experts.2.w1.", ".experts.2.w31."),
        C.EXPERT_TENSOR_UNEXPECTED,
    ),
    # -- a config that already carries our markers
    "config already has a kimi_w31 block": (
        _config_edit(lambda c: c.update(kimi_w31={"format_version": 1})),
        C.ALREADY_MARKED,
    ),
    "quantization_config already wrapped as kimi_w31": (
        _config_edit(_wrap_quantization),
        C.ALREADY_MARKED,
    ),
}


def hostile_cases(
    template: Path,
    work: Path,
    fault: str,
    cases: dict[str, tuple[Callable[[Path], None], Code]],
    manifest: list[str] = MANIFEST,
    name_file: str | None = None,
) -> list[Case]:
    """Each mutation of a clean source, converted through the CLI: must be a clean error
    with its reason code (and naming `name_file`, when given)."""
    rows = []
    for i, (name, (mutate, want)) in enumerate(cases.items()):
        case_dir = work / f"{fault[:8].replace(' ', '_')}{i}"
        case_dir.mkdir(parents=True)
        src = copy_source(template, case_dir / "src")
        mutate(src)
        out = case_dir / "out"
        before = {k: v for k, v in tree(case_dir).items() if not k.startswith("out")}
        code, text, exc = run_inprocess([src, out, *manifest, *SHARD_SIZE, "--json"])
        after = {k: v for k, v in tree(case_dir).items() if not k.startswith("out")}
        outcome, detail = classify_error(code, text, exc, out, before, after, want, name_file)
        if outcome == CLEAN and out.exists():
            outcome, detail = WRONG, "output directory created before validation finished"
        rows.append(Case(fault, name, outcome, detail))
    return rows


def header_cases(template: Path, work: Path) -> list[Case]:
    # Everything a header fault reports names the shard it is in.
    cases = {name: (_on_victim(fn), code) for name, (fn, code) in HEADER_CASES.items()}
    return hostile_cases(template, work, "hostile safetensors header", cases, name_file=VICTIM)


def _on_victim(fn: Callable[[Path], None]) -> Callable[[Path], None]:
    return lambda src: fn(src / VICTIM)


def index_cases(template: Path, work: Path) -> list[Case]:
    return hostile_cases(template, work, "hostile index / source tree", INDEX_CASES)


def plan_cases(template: Path, work: Path) -> list[Case]:
    rows = hostile_cases(template, work, "manifest / planner mismatch", PLAN_CASES)
    # The official manifest's pins against a scaled-down source: every mismatch reported.
    rows += hostile_cases(
        template,
        work / "pinned",
        "manifest / planner mismatch",
        {"pinned manifest vs scaled-down source": (lambda src: None, C.PINNED_MISMATCH)},
        manifest=[],
    )
    return rows


# ---------------------------------------------------------------------------- crashes


def reference_output(src: Path, out: Path, workers: int = 1, *extra: str) -> dict[str, str]:
    """An uninterrupted conversion (default: 300KB shards): the tree every fault must match."""
    proc = run_cli(convert_args(src, out, "--workers", str(workers), *extra))
    assert proc.returncode == 0, proc.stderr
    return tree(out)


def label_totals(src: Path) -> dict[str, int]:
    """How often each fault point is reached in one uninterrupted run."""
    source, _, plan = prepare(
        ConvertOptions(
            source=str(src), out=src.parent / "x", manifest="kimi-k3-any", max_shard_size=300_000
        )
    )
    shards = len(plan.shards)
    extras = len(source.extra_files)
    return {
        "lock.acquired": 1,
        "ledger.opened": 1,
        "shard.header": shards,
        "shard.piece": sum(len(t.pieces) for s in plan.shards for t in s.tensors),
        "shard.fsynced": shards,
        "shard.renamed": shards,
        "ledger.append": shards,
        "ledger.appended": shards,
        "finalize.extra": extras,
        "finalize.checksums": 1,
        "finalize.config": 1,
        "finalize.index": 1,
    }


def kill_points(totals: dict[str, int], per_label: int) -> list[tuple[str, int]]:
    """Up to per_label calls of each label, spread evenly from the first to the last."""
    points = []
    for label, total in totals.items():
        k = min(per_label, total)
        picks = sorted({1 + round(i * (total - 1) / max(1, k - 1)) for i in range(k)})
        points += [(label, n) for n in picks]
    return points


def crash_case(
    src: Path, out: Path, ref: dict[str, str], workers: int, faults: list[str]
) -> tuple[str, str]:
    """Run with each fault in turn (each must kill the run), then without: compare."""
    args = convert_args(src, out, "--workers", str(workers))
    src_before = tree(src)
    for spec in faults:
        proc = run_cli(args, env={"KIMI_W31_FAULT_AT": spec})
        if proc.returncode != -signal.SIGKILL:
            return CRASH, f"{spec}: expected SIGKILL, exit {proc.returncode}: {proc.stderr[-300:]}"
        if (out / INDEX).exists():
            # Killed after the index: it must already be complete and correct.
            done = {k: v for k, v in tree(out).items() if not k.startswith(STATE)}
            if done != ref:
                return WRONG, f"{spec}: complete-looking output differs: {tree_diff(done, ref)}"
    proc = run_cli(args)
    if proc.returncode != 0:
        kind = CRASH if looks_like_crash(proc.stderr) else CLEAN
        return kind, f"rerun exit {proc.returncode}: {proc.stderr[-300:]}"
    got = tree(out)
    if got != ref:
        return WRONG, "differs from an uninterrupted run: " + tree_diff(got, ref)
    if tree(src) != src_before:
        return WRONG, "the source changed"
    return RESUMED, ""


def crash_cases(template: Path, work: Path, workers: int, per_label: int) -> list[Case]:
    src = copy_source(template, work / "src")
    ref = reference_output(src, work / "ref", workers)
    rows = []
    points = kill_points(label_totals(src), per_label)
    for i, (label, n) in enumerate(points):
        out = work / f"out{i}"
        outcome, detail = crash_case(src, out, ref, workers, [f"{label}:{n}"])
        rows.append(Case(f"SIGKILL, --workers {workers}", f"{label} #{n}", outcome, detail))
        shutil.rmtree(out, ignore_errors=True)
    # Killed again while resuming (reused shards, a second stale lock, a rewritten ledger).
    chains = [
        ["shard.renamed:3", "shard.header:2", "ledger.append:4"],
        ["ledger.appended:5", "finalize.config:1"],
    ]
    for chain in chains:
        out = work / f"chain{len(rows)}"
        outcome, detail = crash_case(src, out, ref, workers, chain)
        rows.append(Case(f"SIGKILL, --workers {workers}", " then ".join(chain), outcome, detail))
    verify = run_cli(["verify", work / "ref", "--checksums", "-q"])
    if verify.returncode != 0:
        rows.append(
            Case(f"SIGKILL, --workers {workers}", "reference verifies", WRONG, verify.stderr[-300:])
        )
    return rows


def sigint_cases(template: Path, work: Path) -> list[Case]:
    """Ctrl-C (SIGINT) mid-shard: exit 130, says how to resume; the rerun completes."""
    src = copy_source(template, work / "src")
    ref = reference_output(src, work / "ref", 2)
    rows = []
    for spec in ["shard.piece:20:int", "shard.renamed:4:int", "ledger.append:2:int"]:
        out = work / f"out_{spec.replace(':', '_')}"
        args = convert_args(src, out, "--workers", "2")
        proc = run_cli(args, env={"KIMI_W31_FAULT_AT": spec})
        if looks_like_crash(proc.stderr):
            outcome, detail = CRASH, proc.stderr[-300:]
        elif proc.returncode != 130:
            outcome, detail = CRASH, f"exit {proc.returncode}: {proc.stderr[-300:]}"
        elif (out / INDEX).exists():
            outcome, detail = WRONG, "an interrupted run left an index"
        elif list((out / STATE).glob("lock")):
            outcome, detail = WRONG, "an interrupted run left its lock behind"
        else:
            rerun = run_cli(args)
            got = tree(out)
            outcome, detail = (
                (RESUMED, "exit 130, then resumed")
                if (rerun.returncode == 0 and got == ref)
                else (WRONG, f"rerun exit {rerun.returncode}: {tree_diff(got, ref)}")
            )
        rows.append(Case("SIGINT (Ctrl-C)", spec.rsplit(":", 1)[0], outcome, detail))
    return rows


def torn_ledger_cases(template: Path, work: Path) -> list[Case]:
    """A crash mid-append leaves a torn last ledger line; the next append must not glue to it."""
    src = copy_source(template, work / "src")
    ref = reference_output(src, work / "ref")
    out = work / "out"
    args = convert_args(src, out, "--workers", "1")
    proc = run_cli(args, env={"KIMI_W31_FAULT_AT": "ledger.appended:4"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    ledger = OutputDir(out).ledger_path
    lines = ledger.read_bytes().splitlines(keepends=True)
    torn = b"".join(lines[:-1]) + lines[-1][: len(lines[-1]) // 2]
    ledger.write_bytes(torn)
    # Die again right after the next append: that entry must be readable on the 3rd run.
    proc = run_cli(args, env={"KIMI_W31_FAULT_AT": "ledger.appended:1"})
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    entries = [json.loads(x) for x in ledger.read_text().splitlines()[1:]]  # raises if glued
    rerun = run_cli(args)
    got = tree(out)
    ok = rerun.returncode == 0 and got == ref and len(entries) == 4
    return [
        Case(
            "torn ledger line",
            "torn last line, then killed again, then resumed",
            RESUMED if ok else WRONG,
            "" if ok else f"{len(entries)} entries, exit {rerun.returncode}: {tree_diff(got, ref)}",
        )
    ]


# -------------------------------------------------------------------------- disk full


def _fsize_limit(limit: int) -> Callable[[], None]:
    def apply() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def disk_full_cases(template: Path, work: Path) -> list[Case]:
    """RLIMIT_FSIZE below the largest shard: EFBIG on write, a clean error, then a resume."""
    src = copy_source(template, work / "src")
    ref = reference_output(src, work / "ref", 2)
    largest = max(v for k, v in _sizes(work / "ref").items() if k.endswith(".safetensors"))
    rows = []
    for workers in (1, 2):
        out = work / f"out{workers}"
        args = convert_args(src, out, "--workers", str(workers))
        proc = run_cli([*args, "--json"], preexec_fn=_fsize_limit(largest - 4096))
        text = " ".join(proc.stderr.split())
        named = [
            p
            for p in json_problems(proc.stdout)
            if p.get("code") == Code.NO_SPACE.value and str(out) in (p.get("file") or "")
        ]
        name = f"file size limit below the largest shard, --workers {workers}"
        if looks_like_crash(proc.stderr) or proc.returncode != 1:
            rows.append(Case("disk full", name, CRASH, f"exit {proc.returncode}: {text[-300:]}"))
            continue
        if (out / INDEX).exists():
            rows.append(Case("disk full", name, WRONG, "index written"))
            continue
        if not named:
            rows.append(Case("disk full", name, CRASH, f"no-space not reported: {proc.stdout}"))
            continue
        rerun = run_cli(args)
        got = tree(out)
        ok = rerun.returncode == 0 and got == ref
        rows.append(
            Case(
                "disk full",
                name,
                RESUMED if ok else WRONG,
                named[0]["file"] if ok else tree_diff(got, ref),
            )
        )
    return rows


def _sizes(root: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in root.iterdir() if p.is_file()}


def free_space_cases(template: Path, work: Path) -> list[Case]:
    """The up-front check: a disk that clearly cannot hold the output is refused early."""
    from unittest import mock

    from kimi_w31.converter.errors import Fatal
    from kimi_w31.converter.pipeline import convert

    src = copy_source(template, work / "src")
    out = work / "new" / "out"
    opts = ConvertOptions(source=str(src), out=out, manifest="kimi-k3-any", max_shard_size=300_000)
    _, _, plan = prepare(opts)
    fake = shutil._ntuple_diskusage(10**9, 10**9 - 1000, 1000)  # type: ignore[attr-defined]
    try:
        with mock.patch("shutil.disk_usage", return_value=fake):
            convert(opts)
    except Fatal as exc:
        p = exc.problems[0]
        # Refused before anything was written, and nothing left that looks like a run.
        ok = (
            exc.codes == [Code.NO_SPACE]
            and p.expected == f"{plan.output_bytes} bytes free"
            and p.found == "1000 bytes free"
            and not (work / "new").exists()
        )
        return [
            Case(
                "disk full",
                "free-space check up front",
                CLEAN if ok else WRONG,
                p.render()[:160] if ok else f"{p.render()[:200]}; left: {sorted(tree(work))}",
            )
        ]
    return [Case("disk full", "free-space check up front", WRONG, "converted onto a full disk")]


def dry_run_space_cases(template: Path, work: Path) -> list[Case]:
    """--dry-run states the space the output will take, in the table and in --json."""
    src = copy_source(template, work / "src")
    ref = work / "ref"
    reference_output(src, ref)
    need = sum(p.stat().st_size for p in ref.glob("*.safetensors"))
    proc = run_cli([src, work / "dry", *MANIFEST, *SHARD_SIZE, "--dry-run", "--json"])
    reported = json.loads(proc.stdout).get("output_bytes") if proc.returncode == 0 else None
    text = run_cli([src, work / "dry", *MANIFEST, *SHARD_SIZE, "--dry-run"])
    ok = reported == need and "space needed" in text.stdout and not (work / "dry").exists()
    return [
        Case(
            "disk full",
            "--dry-run reports the space needed",
            CORRECT if ok else WRONG,
            f"output_bytes {reported}, shards on disk {need}",
        )
    ]


# ------------------------------------------------------------------------- concurrency


def _start_stopped(args: list[str], spec: str) -> subprocess.Popen:
    """Start a conversion that stops itself (SIGSTOP) at a fault point; wait until it has."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_W31_")}
    env["KIMI_W31_FAULT_AT"] = spec + ":stop"
    proc = subprocess.Popen(
        cli_cmd() + [str(a) for a in args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        raise RuntimeError(f"conversion ended before reaching {spec}")
    return proc


def _resume(proc: subprocess.Popen) -> tuple[int, str, str]:
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=120)
    return proc.returncode, err, out


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def concurrency_cases(template: Path, work: Path) -> list[Case]:
    import socket

    src = copy_source(template, work / "src")
    ref = reference_output(src, work / "ref")
    host = socket.gethostname()
    rows = []

    # A live run stopped mid-shard holds the lock: a second run, even --force with another
    # plan, must refuse naming pid and host, delete nothing; the first then completes.
    out = work / "live"
    first = _start_stopped(convert_args(src, out, "--workers", "1"), "shard.renamed:3")
    try:
        held = tree(out)
        for name, extra in [
            ("second run, same command", []),
            ("second run, --force and another plan", ["--force", "--max-shard-size", "500KB"]),
        ]:
            proc = run_cli(convert_args(src, out, "--workers", "1", "--json", *extra))
            owner = [
                p["what"]
                for p in json_problems(proc.stdout)
                if p.get("code") == Code.OUTPUT_LOCKED.value
            ]
            good = (
                proc.returncode == 1
                and owner
                and f"pid {first.pid}" in owner[0]
                and host in owner[0]
                and tree(out) == held
            )
            outcome = CRASH if looks_like_crash(proc.stderr) else CLEAN if good else WRONG
            rows.append(Case("concurrent runs", name, outcome, (owner or [proc.stdout])[0][:160]))
    finally:
        code, err, _ = _resume(first)
    got = tree(out)
    rows.append(
        Case(
            "concurrent runs",
            "first run completes after the refusals",
            RESUMED if code == 0 and got == ref else WRONG,
            "" if code == 0 and got == ref else f"exit {code}: {err[-200:]}",
        )
    )

    # Stale lock (dead pid, this host): taken over with a warning.
    out = work / "stale"
    (out / STATE).mkdir(parents=True)
    (out / STATE / "lock").write_text(json.dumps({"pid": _dead_pid(), "host": host}))
    proc = run_cli(convert_args(src, out, "--workers", "1", "--json"))
    warnings = json.loads(proc.stdout).get("warnings") if proc.returncode == 0 else None
    ok = proc.returncode == 0 and warnings and tree(out) == ref
    rows.append(
        Case(
            "concurrent runs",
            "stale lock of a dead pid taken over",
            RESUMED if ok else WRONG,
            str(warnings)[:160] if ok else proc.stderr[-160:],
        )
    )

    # A lock from another host cannot be judged stale from here: refuse, name the owner.
    out = work / "remote"
    (out / STATE).mkdir(parents=True)
    (out / STATE / "lock").write_text(json.dumps({"pid": 4242, "host": "node-b17"}))
    proc = run_cli(convert_args(src, out, "--workers", "1", "--json"))
    owner = [
        p["what"] for p in json_problems(proc.stdout) if p.get("code") == Code.OUTPUT_LOCKED.value
    ]
    good = proc.returncode == 1 and owner and "pid 4242 on node-b17" in owner[0]
    rows.append(
        Case(
            "concurrent runs",
            "lock held on another host",
            CLEAN if good else WRONG,
            (owner or [proc.stdout])[0][:160],
        )
    )
    return rows


# ------------------------------------------------------------ a source changing under us


def _rewrite_data(path: Path) -> None:
    """Same header bytes and size, different tensor bytes (a re-upload of the same layout)."""
    raw = path.read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    flipped = bytes(b ^ 0x01 for b in raw[start : start + 4096])  # low bit: no 0xFF made
    path.write_bytes(raw[:start] + flipped + raw[start + 4096 :])


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _replace(path: Path) -> None:
    tmp = path.with_suffix(".new")
    shutil.copyfile(path, tmp)
    _rewrite_data(tmp)
    os.replace(tmp, path)  # a new inode under the old name


def source_change_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    changes = {
        "truncated": _truncate,
        "rewritten in place": _rewrite_data,
        "replaced (new inode)": _replace,
    }
    for i, (name, change) in enumerate(changes.items()):
        case = work / f"mid{i}"
        src = copy_source(template, case / "src")
        out = case / "out"
        args = convert_args(src, out, "--workers", "1")
        old_ident = list(_identity(src / VICTIM))
        running = _start_stopped([*args, "--json"], "shard.header:2")
        change(src / VICTIM)
        code, err, stdout = _resume(running)
        text = " ".join(err.split())
        reported = [
            p
            for p in json_problems(stdout)
            if p.get("code") == Code.SOURCE_CHANGED.value and p.get("file") == VICTIM
        ]
        ledger = OutputDir(out).ledger_path
        marked = [json.loads(x) for x in ledger.read_text().splitlines()[1:]]
        # Nothing copied from the changed file may be marked done.
        derived_new = [
            e["shard"]
            for e in marked
            if VICTIM in e["sources"] and e["sources"][VICTIM] != old_ident
        ]
        if looks_like_crash(err) or code != 1:
            rows.append(Case("source changes mid-run", name, CRASH, f"exit {code}: {text[-200:]}"))
            continue
        if not reported or (out / INDEX).exists() or derived_new:
            rows.append(
                Case(
                    "source changes mid-run",
                    name,
                    WRONG,
                    f"index={(out / INDEX).exists()} marked={derived_new} {text[:160]}",
                )
            )
            continue
        # Rerun: nothing copied from the old bytes may be kept.
        outcome, detail = _rerun_matches_fresh(src, out, case / "fresh", args)
        rows.append(
            Case(
                "source changes mid-run",
                name,
                CLEAN if outcome == CORRECT else outcome,
                f"[{reported[0]['code']}] {reported[0]['what'][:80]} / rerun: {detail}",
            )
        )
    # Changed between a crash and the rerun: same header and size, so only the recorded
    # source identity tells the finished shards are stale.
    for case, name, killed, change in (
        ("between", "rewritten after a crash, same size/header", True, _rewrite_data),
        (
            "between-mtime",
            "rewritten in place after a crash, same size, header, inode and mtime",
            True,
            _rewrite_keeping_mtime,
        ),
        (
            "after-complete",
            "rewritten in place under a complete output, mtime restored",
            False,
            _rewrite_keeping_mtime,
        ),
    ):
        rows.append(_changed_between_runs(template, work / case, name, killed, change))
    return rows + header_swap_case(template, work / "swap")


def _changed_between_runs(
    template: Path, case: Path, name: str, killed: bool, change: Callable[[Path], None]
) -> Case:
    """A run killed midway (or a finished one), then the source changed, then a rerun: it
    must redo what came from the change and equal a fresh conversion."""
    src = copy_source(template, case / "src")
    out = case / "out"
    args = convert_args(src, out, "--workers", "1")
    if killed:
        proc = run_cli(args, env={"KIMI_W31_FAULT_AT": "shard.renamed:9"})
        assert proc.returncode == -signal.SIGKILL, proc.stderr
    else:
        assert run_cli(args).returncode == 0
    change(src / VICTIM)
    return Case(
        "source changes between runs", name, *_rerun_matches_fresh(src, out, case / "fresh", args)
    )


def _rewrite_keeping_mtime(path: Path) -> None:
    """Rewritten through the same inode, the modification time put back: only ctime tells."""
    st = path.stat()
    _rewrite_in_place(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _rewrite_in_place(path: Path) -> None:
    """Like `_rewrite_data`, but through the same inode (open r+, no new file)."""
    raw = path.read_bytes()
    start = 8 + struct.unpack("<Q", raw[:8])[0]
    with open(path, "r+b") as fh:
        fh.seek(start)
        fh.write(bytes(b ^ 0x01 for b in raw[start : start + 4096]))


def _identity(path: Path) -> tuple[int, int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino


def _rerun_matches_fresh(src: Path, out: Path, fresh: Path, args: list[str]) -> tuple[str, str]:
    """The rerun either refuses cleanly (a broken source) or equals a fresh conversion."""
    rerun = run_cli(args)
    if rerun.returncode != 0:
        text = " ".join(rerun.stderr.split())
        if looks_like_crash(rerun.stderr) or rerun.returncode != 1:
            return CRASH, text[-200:]
        return CORRECT, "refuses the broken source: " + text[text.find("error:") :][:100]
    want = reference_output(src, fresh)
    got = tree(out)
    if got != want:
        return WRONG, "rerun kept bytes of the old source: " + tree_diff(got, want)
    return CORRECT, "redid every shard copied from it; equals a fresh conversion"


# ---------------------------------------------------------------------------- paths


def path_cases(template: Path, work: Path) -> list[Case]:
    rows = []
    src = copy_source(template, work / "src")
    (work / "link").symlink_to(src / "linked-out")
    for name, out in [
        ("output equal to the source", src),
        ("output inside the source", src / "converted"),
        ("output through a symlink into the source", work / "link"),
    ]:
        before = tree(work)
        proc = run_cli(convert_args(src, out, "--json"))
        good = (
            proc.returncode in (1, 2)
            and tree(work) == before
            and codes(proc.stdout) == {Code.OUTPUT_INSIDE_SOURCE.value}
        )
        outcome = CRASH if looks_like_crash(proc.stderr) else CLEAN if good else WRONG
        rows.append(Case("paths", name, outcome, _first_problem(proc.stdout)))
    rows += [
        _force_case(template, work / "force"),
        _hub_cache_case(template, work / "hub"),
        _umask_case(template, work / "umask"),
        _symlinked_dir_case(template, work / "sl"),
    ]
    return rows


def _symlinked_dir_case(template: Path, work: Path) -> Case:
    """A folder of OUT that is a symlink elsewhere must not carry writes out of OUT."""
    src = copy_source(template, work / "src")
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("an extra file in a subdirectory\n")
    elsewhere = work / "elsewhere"
    elsewhere.mkdir()
    out = work / "out"
    out.mkdir()
    (out / "sub").symlink_to(elsewhere, target_is_directory=True)
    proc = run_cli(convert_args(src, out, "--force", "--json"))
    good = (
        proc.returncode == 1
        and not any(elsewhere.iterdir())
        and not (out / INDEX).exists()
        and codes(proc.stdout) == {Code.FOREIGN_OUTPUT.value}
        and (out / "sub").is_symlink()
    )
    outcome = CRASH if looks_like_crash(proc.stderr) else CLEAN if good else WRONG
    return Case(
        "paths",
        "a folder of the output is a symlink elsewhere",
        outcome,
        _first_problem(proc.stdout),
    )


def _force_case(template: Path, work: Path) -> Case:
    """--force over a previous, different conversion: replaces it when every file there is
    one the tool recorded writing; refuses, deleting nothing, when anything else is there."""
    src = copy_source(template, work / "src")
    out = work / "out"
    reference_output(src, out)  # 300KB shards
    args = [src, out, *MANIFEST, "--max-shard-size", "500KB", "-q", "--workers", "1", "--json"]
    refused = run_cli(args)  # another plan: refused without --force
    replaced = run_cli([*args, "--force"])
    want = reference_output(src, work / "fresh500", 1, "--max-shard-size", "500KB")
    ok_replace = (
        codes(refused.stdout) == {Code.OUTPUT_NOT_EMPTY.value}
        and replaced.returncode == 0
        and tree(out) == want
    )
    # Now plant files the tool never wrote, and a tampered record pointing out of OUT.
    outside = work / "keep-me.txt"
    outside.write_text("not yours\n")
    planted = {
        "notes.txt": "mine\n",
        "model-best.safetensors": "a user's own file\n",
        "sub/data.bin": "mine too\n",
    }
    for rel, text in planted.items():
        (out / rel).parent.mkdir(exist_ok=True)
        (out / rel).write_text(text)
    (out / "linked.json").symlink_to(outside)
    sums = json.loads((out / "kimi_w31.checksums.json").read_text())
    sums["files"]["../keep-me.txt"] = {"size": 10}
    sums["files"][str(outside)] = {"size": 10}
    (out / "kimi_w31.checksums.json").write_text(json.dumps(sums))
    before = tree(out)
    forced = run_cli([*args[:4], "--max-shard-size", "300KB", "-q", "--json", "--force"])
    ok_refuse = (
        forced.returncode == 1
        and codes(forced.stdout) == {Code.FOREIGN_OUTPUT.value}
        and tree(out) == before
        and outside.read_text() == "not yours\n"
    )
    ok = ok_replace and ok_refuse
    return Case(
        "paths",
        "--force replaces only what it recorded writing; refuses otherwise",
        CORRECT if ok else WRONG,
        ""
        if ok
        else f"replace={ok_replace} refuse={ok_refuse}: "
        f"{refused.stdout[-100:]} {replaced.stderr[-100:]} {forced.stdout[-200:]} "
        f"{tree_diff(tree(out), before)}",
    )


def hub_cache(template: Path, hub: Path, repo: str = "org/name", rev: str = "0" * 40) -> None:
    """The Hub cache layout: snapshots/<rev>/<file> are relative symlinks into blobs/."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(rev)
    snap = folder / "snapshots" / rev
    for p in sorted(template.rglob("*")):
        if not p.is_file():
            continue
        rel = p.relative_to(template)
        data = p.read_bytes()
        blob = hashlib.sha256(data).hexdigest()
        (folder / "blobs" / blob).write_bytes(data)
        link = snap / rel
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(folder / "blobs" / blob, link.parent))


def _hub_cache_case(template: Path, work: Path) -> Case:
    hub = work / "hub"
    hub_cache(template, hub)
    ref = work / "ref"
    reference_output(template, ref)
    out = work / "out"
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    proc = run_cli(convert_args("org/name", out), env=env)
    verify = run_cli(["verify", out, "--checksums", "-q"])
    # config.json and the checksums file record the source label, which differs by design.
    label_free = ("config.json", "kimi_w31.checksums.json")
    got = {k: v for k, v in tree(out).items() if k not in label_free}
    want = {k: v for k, v in tree(ref).items() if k not in label_free}
    ok = proc.returncode == 0 and verify.returncode == 0 and got == want
    return Case(
        "paths",
        "Hugging Face cache snapshot (symlinks into blobs/) by repo id",
        CORRECT if ok else WRONG,
        ""
        if ok
        else f"exit {proc.returncode}/{verify.returncode}: "
        f"{proc.stderr[-200:]} {tree_diff(got, want)}",
    )


def _umask_case(template: Path, work: Path) -> Case:
    src = copy_source(template, work / "src")
    (src / "sub").mkdir()
    (src / "sub" / "notes.txt").write_text("an extra file in a subdirectory\n")
    out = work / "new" / "out"
    proc = run_cli(convert_args(src, out), preexec_fn=lambda: os.umask(0o077))
    modes = {
        str(p.relative_to(work)): p.stat().st_mode & 0o777
        for p in [work / "new", out, *out.rglob("*")]
    }
    wrong = {k: oct(m) for k, m in modes.items() if m != (0o755 if (work / k).is_dir() else 0o644)}
    ok = proc.returncode == 0 and not wrong and len(modes) > 10
    return Case(
        "paths",
        "permissions under umask 077 (files 0644, dirs 0755)",
        CORRECT if ok else WRONG,
        "" if ok else f"{proc.stderr[-200:]} {wrong}",
    )


# ---------------------------------------------------------------------- data faults


def _plant_nan(path: Path) -> tuple[str, int]:
    """Set one E8M0 scale byte of a w1 scale tensor to 0xFF.

    Returns the w31 tensor it ends up in and its byte position there: rows [0, N) of a w31
    are the w3 half, so the w1 byte lands one w3-sized block further on.
    """
    header, data = read_shard(path)
    name = next(t for t in _tensors(header) if ".w1.weight_scale" in t)
    begin, end = header[name]["data_offsets"]
    pos = 37
    data = data[: begin + pos] + b"\xff" + data[begin + pos + 1 :]
    path.write_bytes(shard_bytes(header, data))
    return name.replace(".w1.", ".w31."), (end - begin) + pos


def data_fault_cases(template: Path, work: Path) -> list[Case]:
    src = copy_source(template, work / "src")
    victim = next(
        p
        for p in sorted(src.glob("*.safetensors"))
        if any(".w1.weight_scale" in t for t in _tensors(read_shard(p)[0]))
    )
    w31, pos = _plant_nan(victim)
    where = f"first at byte {pos} of the tensor"
    out = work / "out"
    args = convert_args(src, out, "--workers", "2", "--check-scales")
    rows = []
    for name in ("--check-scales", "--check-scales again (not hidden by resume)"):
        proc = run_cli([*args, "--json"])
        hits = [
            p
            for p in json_problems(proc.stdout)
            if p.get("code") == Code.SCALE_NAN.value
            and p.get("tensor") == w31
            and where in p.get("what", "")
        ]
        good = proc.returncode == 1 and hits and not (out / INDEX).exists()
        outcome = CRASH if looks_like_crash(proc.stderr) else CLEAN if good else WRONG
        rows.append(
            Case(
                "NaN scale (0xFF)",
                name,
                outcome,
                hits[0]["what"][:200] if hits else proc.stdout[-200:],
            )
        )
    # Without the flag too: E8M0 expert scales are always scanned (faults_library plants NaN
    # in a finished output for verify).
    proc = run_cli([*convert_args(src, out, "--workers", "2"), "--json"])
    hits = [
        p
        for p in json_problems(proc.stdout)
        if p.get("code") == Code.SCALE_NAN.value and p.get("tensor") == w31
    ]
    good = proc.returncode == 1 and hits and not (out / INDEX).exists()
    outcome = CRASH if looks_like_crash(proc.stderr) else CLEAN if good else WRONG
    detail = hits[0]["what"][:200] if hits else proc.stdout[-200:]
    rows.append(Case("NaN scale (0xFF)", "by default (no --check-scales)", outcome, detail))
    return rows


# --------------------------------------------------------------------------- reporting


def bad_rows(rows: list[Case], allowed: set[str]) -> str:
    """The rows whose outcome is not allowed, one a line (empty when all are fine)."""
    return "\n".join(
        f"[{r.outcome}] {r.fault} / {r.name}: {r.detail}" for r in rows if r.outcome not in allowed
    )


def fuzz(examples: int):
    """Hypothesis settings for the property tests: modest by default so `make test` stays
    quick; `KIMI_W31_FUZZ_SCALE=20` (the fault table) runs twenty times as many examples.
    No example database: nothing is written into the checkout."""
    from hypothesis import HealthCheck, settings

    scale = float(os.environ.get("KIMI_W31_FUZZ_SCALE", "1"))
    return settings(
        max_examples=max(1, int(examples * scale)),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


# ----------------------------------------------------------- verify on hostile outputs


def _output_victim(out: Path) -> str:
    """The second shard of a converted output: the one the verify faults are planted in."""
    return sorted(p.name for p in out.glob("model-*.safetensors"))[1]


def verify_hostile_cases(template: Path, work: Path) -> list[Case]:
    """`verify` reads outputs copied from anywhere: each header and index fault planted in a
    converted output must be reported (exit 1, a reason code in `--json`), never crash."""
    src = copy_source(template, work / "src")
    ref = work / "ref"
    reference_output(src, ref)
    victim = _output_victim(ref)
    index_faults = {
        "weight_map entry absolute": "/etc/passwd.safetensors",
        "weight_map entry with ..": "../ref/" + victim,
        "weight_map entry not .safetensors": "config.json",
        "weight_map entry with a NUL byte": "a\x00.safetensors",
        "weight_map entry not a string": 17,
    }
    cases: dict[str, Callable[[Path], None]] = {
        f"header: {n}": (lambda f: lambda out: f(out / victim))(fn)
        for n, (fn, _) in HEADER_CASES.items()
        if n != "tensor the index does not list"
    }
    for n, value in index_faults.items():
        cases[f"index: {n}"] = _index_edit(_map_shard(victim, value))
    cases["index: not JSON"] = _write(INDEX, "{not json")
    cases["index: shard missing"] = lambda out: (out / victim).unlink()
    cases["checksums file not JSON"] = _write("kimi_w31.checksums.json", "[")
    cases["config not JSON"] = _write("config.json", "{")
    rows = []
    for i, (name, mutate) in enumerate(cases.items()):
        out = work / f"v{i}"
        shutil.copytree(ref, out)
        mutate(out)
        before = {k: v for k, v in tree(work).items() if not k.startswith(f"v{i}")}
        code, text, exc = run_inprocess(["verify", out, "--checksums", "--json"])
        after = {k: v for k, v in tree(work).items() if not k.startswith(f"v{i}")}
        flat = " ".join(text.split())
        found = sorted(c for c in codes(text) if c)
        if exc is not None or looks_like_crash(text):
            outcome, detail = CRASH, f"{type(exc).__name__ if exc else 'traceback'}: {flat[-300:]}"
        elif code != 1 or not found:
            outcome, detail = WRONG, f"exit {code}: {flat[-200:]}"
        elif before != after:
            outcome, detail = WRONG, "verify wrote outside the directory it checks"
        else:
            outcome, detail = CLEAN, ", ".join(found)
        rows.append(Case("verify on a hostile output", name, outcome, detail))
        shutil.rmtree(out, ignore_errors=True)
    return rows


def _map_shard(shard: str, value):
    def fn(index: dict) -> None:
        for t, f in index["weight_map"].items():
            if f == shard:
                index["weight_map"][t] = value

    return fn


def verify_fifo_case(template: Path, work: Path) -> list[Case]:
    """An index entry `../x.safetensors` naming a FIFO beside the output: verify must report
    the entry, not open it (opening a FIFO blocks until someone writes to it)."""
    src = copy_source(template, work / "src")
    out = work / "out"
    reference_output(src, out)
    os.mkfifo(work / "fifo.safetensors")
    _index_edit(_map_shard(_output_victim(out), "../fifo.safetensors"))(out)
    try:
        proc = run_cli(["verify", out], timeout=6)  # a clean run takes < 1 s
    except subprocess.TimeoutExpired:
        return [
            Case(
                "verify on a hostile output",
                "index entry ../ naming a FIFO outside",
                CRASH,
                "hangs: verify opens a file outside the output directory",
            )
        ]
    text = " ".join(proc.stderr.split() + proc.stdout.split())
    outcome = (
        CRASH
        if looks_like_crash(text)
        else CLEAN
        if proc.returncode == 1 and ".." in text
        else WRONG
    )
    return [
        Case(
            "verify on a hostile output",
            "index entry ../ naming a FIFO outside",
            outcome,
            text[-160:],
        )
    ]


def lock_race_cases(template: Path, work: Path) -> list[Case]:
    """The lock itself, in-process: a takeover in progress elsewhere, and corrupt content."""
    import fcntl
    import socket

    from kimi_w31.converter.errors import Fatal
    from kimi_w31.converter.lock import OutputLock

    rows = []
    work.mkdir(parents=True, exist_ok=True)
    path = work / "lock"
    path.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    # Another run is taking over this stale lock right now (it holds the flock): refuse.
    other = os.open(path, os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        OutputLock(path).acquire()
        rows.append(
            Case(
                "concurrent runs",
                "two runs take over one stale lock",
                WRONG,
                "both would hold the lock",
            )
        )
    except Fatal as exc:
        rows.append(
            Case(
                "concurrent runs",
                "two runs take over one stale lock",
                CLEAN,
                exc.problems[0].render()[:160],
            )
        )
    finally:
        os.close(other)  # that run died too: now the lock is ours to take
    lock = OutputLock(path)
    lock.acquire()
    ours = json.loads(path.read_text())["pid"] == os.getpid() and lock.warning
    lock.release()
    rows.append(
        Case(
            "concurrent runs",
            "stale lock taken over once the other taker is gone",
            CORRECT if ours and not path.exists() else WRONG,
            str(lock.warning),
        )
    )
    for name, content in [
        ("lock file with a non-integer pid", '{"pid": "x", "host": "h"}'),
        ("lock file that is not JSON", "\0\0garbage"),
        ("lock file naming pid -1", json.dumps({"pid": -1, "host": socket.gethostname()})),
    ]:
        path.write_text(content)
        try:
            OutputLock(path).acquire()
            rows.append(Case("concurrent runs", name, WRONG, "taken over"))
        except Fatal as exc:
            rows.append(Case("concurrent runs", name, CLEAN, exc.problems[0].render()[:160]))
        except Exception as exc:  # the point is to classify anything else
            rows.append(Case("concurrent runs", name, CRASH, f"{type(exc).__name__}: {exc}"))
    return rows


def _swap_equal_tensors(path: Path) -> None:
    """Same size, same tensor names, two equal-sized tensors' offsets exchanged: a different
    checkpoint that a size/mtime check alone cannot tell from the planned one."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    names = _tensors(header)
    a, b = next(
        (x, y)
        for i, x in enumerate(names)
        for y in names[i + 1 :]
        if header[x]["dtype"] == header[y]["dtype"] and header[x]["shape"] == header[y]["shape"]
    )
    header[a]["data_offsets"], header[b]["data_offsets"] = (
        header[b]["data_offsets"],
        header[a]["data_offsets"],
    )
    body = json.dumps(header, separators=(",", ":")).encode()
    body = body + b" " * (n - len(body))  # keep the header length, so the file size stays
    assert len(body) == n
    path.write_bytes(raw[:8] + body + raw[8 + n :])


def header_swap_case(template: Path, work: Path) -> list[Case]:
    """The source's header changes after planning (same size): never copy with a stale plan."""
    src = copy_source(template, work / "src")
    out = work / "out"
    args = convert_args(src, out, "--workers", "1")
    running = _start_stopped([*args, "--json"], "lock.acquired:1")
    _swap_equal_tensors(src / VICTIM)
    code, err, stdout = _resume(running)
    name = "header rewritten between planning and copying"
    if looks_like_crash(err):
        return [Case("source changes mid-run", name, CRASH, err[-200:])]
    if code == 0:
        return [Case("source changes mid-run", name, WRONG, "converted with the stale plan")]
    reported = [
        p
        for p in json_problems(stdout)
        if p.get("code") == Code.SOURCE_CHANGED.value and p.get("file") == VICTIM
    ]
    good = code == 1 and reported and not (out / INDEX).exists()
    return [Case("source changes mid-run", name, CLEAN if good else WRONG, stdout[:200])]


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
