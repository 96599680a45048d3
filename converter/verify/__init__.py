"""`kimi-convert verify OUT`: prove a converted checkpoint complete, intact and correct.

Levels, each including the ones before it:
  structure  (default)   headers, index, manifest-as-converted, config block; no data read
  checksums  (--checksums) every tensor re-hashed against the checksums written at conversion
  source     (--source)  every output tensor equals its source bytes (w31 = w3 ++ w1)
  numerics   (--numerics) sampled experts computed from source and converted semantics agree
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from .config_rewrite import BLOCK_KEY, QUANT_METHOD, REQUIRED_BLOCK, unwrap_config
from .convert import CHECKSUMS_NAME, STATE_DIR
from .errors import ConvertError, Problem
from .manifest import Manifest, check_expert_tensors, config_value, load_manifest, resolve_dims
from .plan import plan_conversion
from .safetensors_format import ShardHeader, read_header
from .source import (
    CONFIG_NAME,
    INDEX_NAME,
    _check_shard_name,
    check_index_against_headers,
    check_weight_map,
    read_json,
    read_source,
    resolve_source,
)
from .streaming import CHUNK_SIZE, HASH_NAME, HashPipe, hash_ranges, hash_tensors, new_hash

MAX_PROBLEMS_KEPT = 1000


@dataclass
class Check:
    name: str
    ok: bool | None  # None: skipped
    detail: str
    problems: list[Problem] = field(default_factory=list)


@dataclass
class VerifyReport:
    output: str
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    def add(self, name: str, problems: list[Problem], detail: str) -> Check:
        check = Check(name, not problems, detail, problems[:MAX_PROBLEMS_KEPT])
        self.checks.append(check)
        return check

    def as_dict(self) -> dict:
        return {
            "output": self.output,
            "ok": self.ok,
            "checks": [
                {"name": c.name, "ok": c.ok, "detail": c.detail,
                 "problems": [p.as_dict() for p in c.problems]}
                for c in self.checks
            ],
        }  # fmt: skip


@dataclass
class Converted:
    """The output as read from headers: what every level works from."""

    root: Path
    config: dict
    weight_map: dict[str, str]
    headers: dict[str, ShardHeader]
    manifest: Manifest | None


def check_structure(root: Path, manifest_name: str | None, report: VerifyReport) -> Converted:
    problems: list[Problem] = []
    index_path = root / INDEX_NAME
    if not index_path.exists():
        detail = "no index: conversion incomplete or not a converted checkpoint"
        if (root / STATE_DIR).exists():
            detail += " (a run is in progress or was interrupted; rerun kimi-convert to finish)"
        report.add("index", [Problem(detail, file=INDEX_NAME)], "missing")
        raise _Stop()
    index = read_json(index_path)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        report.add("index", [Problem("index has no weight_map", file=INDEX_NAME)], "malformed")
        raise _Stop()
    problems.extend(check_weight_map(root, weight_map, INDEX_NAME))
    # Open only names that passed those checks: never a path outside OUT, never a non-string.
    names = {f for f in weight_map.values() if isinstance(f, str)}  # once per shard, not tensor
    files = sorted(f for f in names if _check_shard_name(root, f) is None)
    headers: dict[str, ShardHeader] = {}
    for f in files:
        if not (root / f).is_file():  # missing, or a directory/FIFO (a FIFO blocks the read)
            problems.append(Problem("shard named in the index is missing", file=f))
            continue
        try:
            headers[f] = read_header(root / f, display_name=f)
        except ConvertError as exc:
            problems.extend(exc.problems)
    problems.extend(check_index_against_headers(weight_map, headers, INDEX_NAME))
    for stray in sorted(p.name for p in root.glob("*.safetensors")):
        if stray not in headers and stray not in files:
            problems.append(Problem("safetensors file not referenced by the index", file=stray))
    data_bytes = sum(t.nbytes for h in headers.values() for t in h.tensors.values())
    total = (index.get("metadata") or {}).get("total_size")
    if total != data_bytes and not problems:
        problems.append(Problem("metadata.total_size is wrong", file=INDEX_NAME,
                                expected=str(data_bytes), found=repr(total)))  # fmt: skip
    report.add("shards and index", problems,
               f"{len(files)} shards, {len(weight_map)} tensors, headers parsed")  # fmt: skip

    config = read_json(root / CONFIG_NAME)
    block_problems, manifest = check_config_block(config, manifest_name)
    report.add("config.json kimi_w31 block", block_problems,
               f"manifest {manifest.name if manifest else '?'}")  # fmt: skip

    expert_problems: list[Problem] = []
    detail = "skipped: no usable manifest"
    if manifest is not None:
        dims, dim_problems = resolve_dims(manifest, config)
        tensors = ((f, t) for f, h in headers.items() for t in h.tensors.values())
        layers, expert_problems = check_expert_tensors(manifest, dims, tensors, converted=True)
        expert_problems = dim_problems + expert_problems
        if not layers:
            expert_problems.append(Problem("no routed-expert (w31) tensors found"))
        detail = (
            f"{len(layers)} MoE layers x {dims.values.get('E')} experts, manifest {manifest.name}"
        )
    report.add("expert tensors (as converted)", expert_problems, detail)
    return Converted(root, config, weight_map, headers, manifest)


def check_config_block(
    config: dict, manifest_name: str | None
) -> tuple[list[Problem], Manifest | None]:
    problems: list[Problem] = []
    block = config.get(BLOCK_KEY)
    if not isinstance(block, dict):
        return [Problem(f"config.json has no {BLOCK_KEY} block", file=CONFIG_NAME)], None
    for key, want in REQUIRED_BLOCK.items():
        if key == "group_size":
            continue
        if block.get(key) != want:
            problems.append(
                Problem(
                    f"{BLOCK_KEY}.{key} is wrong",
                    file=CONFIG_NAME,
                    expected=json.dumps(want),
                    found=json.dumps(block.get(key)),
                )
            )
    name = manifest_name or block.get("manifest") or "kimi-k3-any"
    try:
        manifest = load_manifest(name)
    except ConvertError as exc:
        return problems + exc.problems, None
    if block.get("group_size") != manifest.group_size:
        problems.append(
            Problem(
                f"{BLOCK_KEY}.group_size is wrong",
                file=CONFIG_NAME,
                expected=str(manifest.group_size),
                found=repr(block.get("group_size")),
            )
        )
    keys = manifest.raw["situ"]["config_keys"]
    for field_name, want in (
        ("situ_beta", manifest.situ_beta),
        ("situ_linear_beta", manifest.situ_linear_beta),
    ):
        value = block.get(field_name)
        in_config = config_value(config, keys[field_name.removeprefix("situ_")])
        if value != want:
            problems.append(
                Problem(
                    f"{BLOCK_KEY}.{field_name} disagrees with manifest {manifest.name}",
                    file=CONFIG_NAME,
                    expected=repr(want),
                    found=repr(value),
                )
            )
        if in_config is None or value != in_config:
            problems.append(
                Problem(
                    f"{BLOCK_KEY}.{field_name} disagrees with the model config's "
                    f"{keys[field_name.removeprefix('situ_')]}",
                    file=CONFIG_NAME,
                    expected=repr(in_config),
                    found=repr(value),
                )
            )
    wrapped = 0
    for holder in (config, config.get("text_config")):
        q = holder.get("quantization_config") if isinstance(holder, dict) else None
        if isinstance(q, dict):
            if q.get("quant_method") != QUANT_METHOD or not isinstance(q.get("base"), dict):
                problems.append(
                    Problem(
                        "quantization_config is not wrapped (fail-closed)",
                        file=CONFIG_NAME,
                        expected=f'quant_method "{QUANT_METHOD}" with "base"',
                        found=repr(q.get("quant_method")),
                    )
                )
            wrapped += 1
    if not wrapped:
        problems.append(Problem("config.json has no quantization_config", file=CONFIG_NAME))
    return problems, manifest  # fmt: skip


class _Stop(Exception):
    """Structure is too broken for the deeper levels to mean anything."""


def _tensor_ranges(header: ShardHeader) -> list[tuple[str, int, int]]:
    return [
        (t.name, t.begin, t.end) for t in sorted(header.tensors.values(), key=lambda t: t.begin)
    ]


def check_checksums(
    conv: Converted, report: VerifyReport, workers: int, on_bytes: Callable[[int], None] | None
) -> dict[str, str]:
    """Re-hash every tensor of every shard (parallel across files); returns tensor -> digest."""
    problems: list[Problem] = []
    try:
        recorded = read_json(conv.root / CHECKSUMS_NAME)
        files = recorded["files"]
        if recorded.get("tensor_checksum") != HASH_NAME:
            report.add("checksums", [Problem("unknown tensor checksum", file=CHECKSUMS_NAME,
                                             expected=HASH_NAME,
                                             found=repr(recorded.get("tensor_checksum")))],
                       "cannot check")  # fmt: skip
            return {}
    except (ConvertError, KeyError, TypeError, AttributeError):
        report.add(
            "checksums",
            [Problem("checksum file is missing or malformed", file=CHECKSUMS_NAME)],
            "cannot check",
        )
        return {}
    digests: dict[str, str] = {}
    lock = threading.Lock()

    def one(file: str) -> list[Problem]:
        header = conv.headers[file]
        want = files.get(file)
        found: list[Problem] = []
        if want is None:
            return [Problem("shard has no recorded checksums", file=file)]
        if header.file_size != want.get("size"):
            found.append(
                Problem(
                    "file size differs from the conversion record",
                    file=file,
                    expected=str(want.get("size")),
                    found=str(header.file_size),
                )
            )
        with open(conv.root / file, "rb") as fh:
            raw = fh.read(header.data_start)
        if _sha(raw) != want.get("header_sha256"):
            found.append(Problem("header bytes differ from the conversion record", file=file))
        pipe = HashPipe(CHUNK_SIZE)
        try:
            got, scans = hash_tensors(
                str(conv.root / file),
                _tensor_ranges(header),
                pipe,
                progress=on_bytes,
                scan=lambda n: n.endswith("weight_scale"),
            )
        finally:
            pipe.close()
        for name, digest in got.items():
            if want.get("tensors", {}).get(name) != digest:
                found.append(
                    Problem(
                        "tensor bytes differ from the conversion record (corrupt)",
                        file=file,
                        tensor=name,
                    )
                )
        for name, scan in scans.items():
            if scan.count:
                found.append(
                    Problem(
                        f"{scan.count} E8M0 scale byte(s) are 0xFF (NaN); first at "
                        f"byte {scan.first} of the tensor",
                        file=file,
                        tensor=name,
                    )
                )
        with lock:
            digests.update(got)
        return found

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        for result in pool.map(one, sorted(conv.headers)):
            problems.extend(result)
    for rel, want in files.items():
        if rel in conv.headers or "sha256" not in want:
            continue
        path = conv.root / rel
        if not path.is_file():
            problems.append(Problem("file recorded at conversion is missing", file=rel))
        elif _sha_file(path) != want["sha256"]:
            problems.append(Problem("file differs from the conversion record", file=rel))
    others = len(files) - len(conv.headers)
    detail = f"{len(digests)} tensors ({HASH_NAME}), {others} other files (sha256) re-hashed"
    report.add("checksums", problems, detail)
    return digests


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _sha_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(CHUNK_SIZE):
            h.update(chunk)
    return h.hexdigest()


def check_against_source(conv: Converted, source_spec: str, digests: dict[str, str],
                         report: VerifyReport, workers: int,
                         on_bytes: Callable[[int], None] | None):  # fmt: skip
    """Hash the source byte ranges each output tensor must consist of, and compare."""
    root = resolve_source(source_spec)
    source = read_source(root, source_spec)
    changed = []
    recorded = (conv.config.get(BLOCK_KEY) or {}).get("source", {}).get("files", {})
    for f, h in source.headers.items():
        rec = recorded.get(f)
        if rec is not None and (
            rec.get("size") != h.file_size or rec.get("header_sha256") != h.header_sha256
        ):
            changed.append(Problem("source file changed since conversion (not output corruption)",
                                   file=f))  # fmt: skip
    if changed:
        report.add("source unchanged since conversion", changed, f"{len(changed)} changed")
    manifest = conv.manifest or load_manifest("kimi-k3-any")
    plan = plan_conversion(source, manifest, max_shard_size=1 << 62)
    expected = {t.name: t for s in plan.shards for t in s.tensors}
    problems: list[Problem] = []
    missing = sorted(set(expected) - set(digests))
    extra = sorted(set(digests) - set(expected))
    problems += [Problem("tensor expected from the source is missing", tensor=n) for n in missing]
    problems += [Problem("tensor has no counterpart in the source", tensor=n) for n in extra]
    if unwrap_config(conv.config) != source.config:
        problems.append(
            Problem(
                "config.json differs from the source config beyond the kimi_w31 "
                "block and the wrapped quantization_config",
                file=CONFIG_NAME,
            )
        )
    names = sorted(set(expected) & set(digests))

    local = threading.local()  # one read buffer per worker thread, not per tensor

    def one(name: str) -> Problem | None:
        t = expected[name]
        h = new_hash()
        if not hasattr(local, "view"):
            local.view = memoryview(bytearray(CHUNK_SIZE))
        fds = [os.open(root / p.file, os.O_RDONLY) for p in t.pieces]
        try:
            ranges = [(fd, p.offset, p.length, p.file) for fd, p in zip(fds, t.pieces, strict=True)]
            hash_ranges([((h,), ranges)], local.view, progress=on_bytes)
        finally:
            for fd in fds:
                os.close(fd)
        if h.hexdigest() != digests[name]:
            what = (
                "w31 is not concat([w3, w1]) of the source"
                if ".w31." in name
                else "tensor bytes differ from the source"
            )
            return Problem(what, file=conv.weight_map.get(name), tensor=name)
        return None

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        problems += [p for p in pool.map(one, names) if p is not None]
    for rel in source.extra_files:
        out_file = conv.root / rel
        if not out_file.is_file() or _sha_file(out_file) != _sha_file(root / rel):
            problems.append(Problem("extra file differs from the source", file=rel))
    report.add("matches source", problems, f"{len(names)} tensors compared with {source_spec}")
    return source


def check_numerics(conv: Converted, source, report: VerifyReport, sample: int | None,
                   seed: int) -> None:  # fmt: skip
    from .numerics import compare_experts

    problems, detail = compare_experts(conv, source, sample, seed)
    report.add("numerics (source vs converted semantics)", problems, detail)


def verify(root: Path, manifest: str | None = None, checksums: bool = False,
           source: str | None = None, numerics: bool = False, sample: int | None = 8,
           seed: int = 0, workers: int = 2,
           on_bytes: Callable[[int], None] | None = None) -> VerifyReport:  # fmt: skip
    report = VerifyReport(str(root))
    try:
        conv = check_structure(root, manifest, report)
        if not (checksums or source or numerics):
            return report
        digests = check_checksums(conv, report, workers, on_bytes)
        if source:
            src = check_against_source(conv, source, digests, report, workers, on_bytes)
            if numerics:
                check_numerics(conv, src, report, sample, seed)
    except _Stop:
        pass
    return report


def sample_experts(layers: list[str], num_experts: int, sample: int | None, seed: int):
    everything = [(layer, e) for layer in layers for e in range(num_experts)]
    if sample is None or sample >= len(everything):
        return everything
    return sorted(random.Random(seed).sample(everything, sample))
