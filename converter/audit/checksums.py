"""Level 2, `--checksums`: every byte of the output against what the conversion recorded.

Per shard: size, the header's sha256 (length prefix + JSON, `shard_header_sha256`), the
safetensors library's own reading of the file (`library_problem`), and the CRC-32 of every
tensor; E8M0 scale tensors (`contract.is_e8m0_scale`, the ones convert scans) are also
scanned for 0xFF (NaN) bytes, counted with the first position. Every other recorded file:
size and sha256. Files are read in parallel (`workers`), each through one bounded buffer.

What this proves: the output is what the conversion wrote, against accidents (bad disks,
torn or partial copies). It is not tamper-proof: the checksums live next to the data, and
anyone who can edit a tensor can edit its record (or forge 4 bytes to keep a CRC-32). The
proof against the source is `--source`.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

from .. import contract
from ..errors import Problem, problem
from ..hashing import CHUNK_SIZE, Crc32, ScaleScan, ShortRead, hash_ranges, shard_header_sha256
from ..reasons import Code
from ..safetensors_format import ShardHeader, library_problem
from ..text import human
from .files import is_regular, load_checksums
from .meter import MeterFactory
from .report import VerifyReport
from .streams import open_regular, run_jobs, sha256_of
from .structure import Output

LEVEL = "checksums"


@dataclass(frozen=True)
class _FileCheck:
    file: str
    record: dict
    header: ShardHeader | None  # None: not a shard (sha256 of the whole file)
    size: int  # bytes this check reads (for the progress total)


def check_checksums(out: Output, workers: int, meter: MeterFactory, report: VerifyReport) -> None:
    title = f"checksums ({contract.CHECKSUMS_NAME})"
    table, problems = load_checksums(out.root)
    if table is None:
        report.add("checksums", LEVEL, title, problems, "cannot check")
        return
    checks, unrecorded = _checks(out, table)
    problems += unrecorded
    total = sum(j.size for j in checks)
    with meter("verify --checksums", total, "bytes") as progress:
        problems += run_jobs(
            lambda check, stop: _run(out, check, stop, progress.advance), checks, workers
        )
    tensors = sum(len(j.header.tensors) for j in checks if j.header is not None)
    shards = sum(j.header is not None for j in checks)
    report.add(
        "checksums",
        LEVEL,
        title,
        problems,
        f"{tensors} tensors (CRC-32) in {shards} shards, {len(checks) - shards} other files "
        f"(sha256), {human(total)} read",
    )


def _checks(out: Output, table: dict[str, dict]) -> tuple[list[_FileCheck], list[Problem]]:
    checks, problems = [], []
    for name, header in out.headers.items():
        record = table.get(name)
        if record is None or "header_sha256" not in record:
            problems.append(problem(Code.CHECKSUMS_INVALID, rule="no-shard-record", file=name))
        else:
            checks.append(_FileCheck(name, record, header, header.file_size))
    for name, record in table.items():
        if "header_sha256" in record:
            continue  # a shard: checked above if the index names it (structure says if not)
        path = out.root / name
        if not is_regular(path):  # missing or special: the structure level said which
            continue
        checks.append(_FileCheck(name, record, None, path.stat().st_size))
    return checks, problems


def _run(out: Output, check: _FileCheck, stop: threading.Event, advance) -> list[Problem]:
    try:
        if check.header is None:
            return _check_file(out, check, stop, advance)
        return _check_shard(out, check, stop, advance)
    except ShortRead as exc:
        return [problem(Code.FILE_TRUNCATED, rule="read", file=check.file, offset=exc.offset)]
    except OSError as exc:
        error = exc.strerror or exc
        return [problem(Code.FILE_UNREADABLE, rule="read", file=check.file, error=error)]


def _check_file(out: Output, check: _FileCheck, stop: threading.Event, advance) -> list[Problem]:
    record, size = check.record, check.size
    if size != record["size"]:
        advance(size)
        want = record["size"]
        return [
            problem(Code.FILE_SIZE_MISMATCH, rule="file", file=check.file, want=want, size=size)
        ]
    if sha256_of(out.root / check.file, stop, advance) != record["sha256"]:
        return [problem(Code.CHECKSUM_MISMATCH, rule="file", file=check.file)]
    return []


def _check_shard(out: Output, check: _FileCheck, stop: threading.Event, advance) -> list[Problem]:
    header, record, name = check.header, check.record, check.file
    assert header is not None
    problems = []
    if header.file_size != record["size"]:
        problems.append(
            problem(
                Code.FILE_SIZE_MISMATCH,
                rule="shard",
                file=name,
                want=record["size"],
                size=header.file_size,
            )
        )
    if shard_header_sha256(out.root / name) != record["header_sha256"]:
        problems.append(problem(Code.HEADER_HASH_MISMATCH, file=name))
    # The whole file is read here anyway: the library's own verdict on it costs a header
    # parse (the strict reader restates the library's rules; this is the consumer itself).
    refused = library_problem(out.root / name, header)
    if refused is not None:
        problems.append(refused)
    advance(header.data_start)
    recorded = record["tensors"]
    crcs, scans = _hash_tensors(out, header, stop, advance)
    for tensor, crc in crcs.items():
        want = recorded.get(tensor)
        if want is None:
            problems.append(
                problem(Code.CHECKSUMS_INVALID, rule="no-tensor-record", file=name, tensor=tensor)
            )
        elif want != crc:
            problems.append(
                problem(
                    Code.CHECKSUM_MISMATCH,
                    rule="tensor",
                    file=name,
                    tensor=tensor,
                    want=want,
                    crc=crc,
                )
            )
    problems += [
        problem(Code.CHECKSUMS_INVALID, rule="tensor-not-in-shard", file=name, tensor=t)
        for t in sorted(recorded.keys() - crcs.keys())
    ]
    for tensor, scan in scans.items():
        if scan.count:
            problems.append(
                problem(
                    Code.SCALE_NAN,
                    rule="tensor",
                    file=name,
                    tensor=tensor,
                    count=scan.count,
                    first=scan.first,
                )
            )
    return problems


def _hash_tensors(
    out: Output, header: ShardHeader, stop: threading.Event, advance
) -> tuple[dict[str, str], dict[str, ScaleScan]]:
    """CRC-32 of every tensor of a shard, in offset order, and 0xFF scans of scales."""
    crcs: dict[str, Crc32] = {}
    scans: dict[str, ScaleScan] = {}
    fd = open_regular(out.root / header.file)
    try:
        checks = []
        for info in header.tensors.values():
            crcs[info.name] = Crc32()
            targets: tuple = (crcs[info.name],)
            if contract.is_e8m0_scale(info.name, info.dtype):
                scans[info.name] = ScaleScan()
                targets = (crcs[info.name], scans[info.name])
            checks.append((targets, [(fd, info.begin, info.nbytes, header.file)]))
        hash_ranges(checks, memoryview(bytearray(CHUNK_SIZE)), stop, advance)
    finally:
        os.close(fd)
    return {n: c.hexdigest() for n, c in crcs.items()}, scans
