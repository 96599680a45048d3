"""One output shard: keep it (after proof) or write it. The core every executor shares.

`settle` is the one place that decides. A shard an earlier run recorded is kept only if it
is proven to the standard of this run's options: the file is there with the recorded size
and header bytes, its source files are the very files it was copied from, (with `--rehash`)
every tensor still has its recorded checksum and (with `--check-scales`) its scales pass the
scan a written shard's pass. Anything else is written: to a temporary name under the state
folder, space reserved up front, streamed (header, then each tensor's source byte ranges)
with a CRC-32 of every tensor computed beside the copy, fsynced, checked against the source
identities taken before the run, and renamed into place. A NaN scale is reported against
the source file and tensor holding it (`scale_nan_problem`). The caller records the outcome
in the ledger (`commit`): local, Hub and Ray executors only schedule.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from .. import contract, faults, fsio
from ..errors import Problem, problem
from ..hashing import (
    Crc32,
    ScaleScan,
    ShortRead,
    crc32_of_ranges,
    sha256_bytes,
    source_header_sha256,
)
from ..output.directory import SPACE_ERRNOS
from ..output.records import Ledger, ShardRecord
from ..plan import OutputShard, OutputTensor, Piece
from ..reasons import Code
from ..source.hub_cache import content_id
from .byte_ranges import RangeHasher, copy_range, write_all


class SourceChanged(Exception):
    def __init__(self, file: str, detail: str) -> None:
        super().__init__(f"{file}: {detail}")
        self.file = file
        self.detail = detail

    def __reduce__(self) -> tuple:  # pickled by its fields, as Fatal is
        return (type(self), (self.file, self.detail))


def file_identity(path: Path) -> list[int]:
    """What a source file is now, links followed (`fsio.identity`)."""
    return fsio.identity(os.stat(path))


class SourceFiles:
    """Source shards opened once, shared by all workers (pread is positional, thread-safe)."""

    def __init__(
        self, root: Path, files: list[str], header_sha256: dict[str, str] | None = None
    ) -> None:
        self.root = root
        self.identity = {f: file_identity(root / f) for f in files}
        # What records keep: a Hub file's content id wherever it was read from, so the
        # cache path and --download agree (`hub_cache.content_id`); else the file itself.
        self.content = {f: content_id(root, f) or self.identity[f] for f in files}
        # The headers the plan was made from: a file rewritten between planning and this
        # snapshot (same size, new layout) would otherwise be copied with stale offsets.
        self.header_sha256 = header_sha256 or {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                fd = fsio.open_regular(self.root / file)  # a link to a regular file is fine
                if os.fstat(fd).st_ino != self.identity[file][3]:
                    os.close(fd)
                    raise SourceChanged(file, "was replaced since the run started")
                want = self.header_sha256.get(file)
                if want and source_header_sha256(fd) != want:
                    os.close(fd)
                    raise SourceChanged(file, "changed since it was planned (header differs)")
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self._fds[file] = fd
            return self._fds[file]

    def check_unchanged(
        self, files: list[str], others: Mapping[str, list[int]] | None = None
    ) -> None:
        """Each of `files` (source shards) and of `others` (rel name -> identity when read:
        the config, the index, the files copied) is still the file the run read."""
        seen = {f: self.identity[f] for f in files} | dict(others or {})
        for file, then in seen.items():
            try:
                now = file_identity(self.root / file)
            except OSError:
                raise SourceChanged(file, "disappeared during the run") from None
            if now != list(then):
                raise SourceChanged(
                    file,
                    "changed during the run (size, modification or change time, or inode differ)",
                )

    def check_seen(self, seen: Mapping[str, list[int]], detail: str) -> None:
        """Each file of `seen` (name -> the identity another process took of it: a Ray
        driver's) is that very file here, as opened by this object; else `SourceChanged`
        saying `detail`."""
        for file, then in seen.items():
            if list(self.identity[file]) != list(then):
                raise SourceChanged(file, detail)

    def prove_unchanged(self, others: Mapping[str, list[int]]) -> None:
        """Before an output is published: every source file it derives from is still the
        file read, every shard this run holds an identity of (kept ones too: a proof made
        against identities taken at the start says nothing of a file replaced since) and
        `others`. A file an executor let go of (`drop`) is proven by its content instead."""
        self.check_unchanged(list(self.identity), others)

    def fingerprint(self, files: list[str]) -> dict[str, list]:
        """What a record says about the source files a shard was copied from."""
        return {f: list(self.content[f]) for f in files}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass
class ShardEvents:
    """What a run is told as its shards progress: callbacks, all optional, called from
    worker threads."""

    on_bytes: Callable[[int], None] | None = None  # bytes written (or re-read to prove)
    on_scale_nan: Callable[[Problem], None] | None = None
    before_write: Callable[[], None] | None = None  # the first change to the output dir


@dataclass
class ShardContext:
    """What every shard of one run is settled in: the source files, where shards go, the
    stop signal, the progress events, and what proving a kept shard re-reads."""

    sources: SourceFiles
    out_dir: Path
    tmp_dir: Path
    stop: threading.Event = field(default_factory=threading.Event)
    events: ShardEvents = field(default_factory=ShardEvents)
    check_scales: bool = False  # also non-expert U8 `*.weight_scale` (E8M0 experts: always)
    rehash: bool = False  # prove kept shards by re-hashing their data too


class Outcome(Enum):
    WRITTEN = "written"
    KEPT = "kept"
    REJECTED = "rejected"  # NaN (0xFF) E8M0 scales: neither kept nor recorded


@dataclass
class ShardOutcome:
    shard: str
    outcome: Outcome
    record: ShardRecord | None = None
    bytes_written: int = 0
    redo_reason: str | None = None  # why an earlier run's shard was not kept


def settle(shard: OutputShard, record: ShardRecord | None, context: ShardContext) -> ShardOutcome:
    """Keep the shard if `record` is proven for it, else write it."""
    reason = why_not_kept(shard, record, context)
    if reason is None:
        return ShardOutcome(shard.name, Outcome.KEPT, record)
    return write(shard, context, reason if record is not None else None)


def why_not_kept(
    shard: OutputShard, record: ShardRecord | None, context: ShardContext
) -> str | None:
    """None if an earlier run's shard may be kept; else the reason it must be written. (The
    Hub executor asks this before it downloads, and writes once the sources are there.)"""
    if record is None:
        return "not written yet"
    return prove(shard, record, context)


def write(shard: OutputShard, context: ShardContext, reason: str | None = None) -> ShardOutcome:
    """Write the shard (it was not kept: `reason` says why, None if it never existed)."""
    if context.events.before_write:
        context.events.before_write()
    new = write_shard(shard, context)
    if new is None:
        return ShardOutcome(shard.name, Outcome.REJECTED, redo_reason=reason)
    return ShardOutcome(shard.name, Outcome.WRITTEN, new, shard.file_size, reason)


def commit(result: ShardOutcome, ledger: Ledger) -> None:
    """Record an outcome (driver side): a written shard's record, a rejected shard forgotten.
    (`write` gives every written outcome its record; a kept one is on record already.)"""
    match result:
        case ShardOutcome(outcome=Outcome.WRITTEN, record=ShardRecord() as record):
            ledger.record(record)
        case ShardOutcome(outcome=Outcome.REJECTED):
            ledger.forget(result.shard)


def prove(shard: OutputShard, record: ShardRecord, context: ShardContext) -> str | None:
    """None if the recorded shard is proven to be this plan's shard; else why not."""
    path = context.out_dir / shard.name
    if record.sources != context.sources.fingerprint(shard.input_files):
        return "its source files changed since it was written"
    try:
        if path.is_symlink() or not path.is_file():
            return "the file is missing"
        if path.stat().st_size != shard.file_size or record.size != shard.file_size:
            return "the file has the wrong size"
        with os.fdopen(fsio.open_regular(path, follow=False), "rb") as fh:
            if fh.read(len(shard.header)) != shard.header:
                return "its header differs"
    except OSError:
        return "the file cannot be read"
    if record.header_sha256 != sha256_bytes(shard.header):
        return "its record belongs to another layout"
    return _prove_data(path, shard, record, context)


def _prove_data(
    path: Path, shard: OutputShard, record: ShardRecord, context: ShardContext
) -> str | None:
    """A kept shard held to the standard a written one is, under this run's options: every
    scale this run would scan while writing (`--check-scales`: every U8 `*.weight_scale`)
    is scanned here too, and with `--rehash` every tensor's checksum is proven. A record
    proves only the scans every run makes (routed-expert scales: a shard with NaN there is
    never recorded), so only the others are read without --rehash, with their checksums
    (what is scanned is what was recorded). A NaN found is a reason to write the shard
    again: the write reads the source and reports the source tensor that holds it."""

    def scanned(t: OutputTensor) -> bool:
        return contract.is_e8m0_scale(t.name, t.dtype, context.check_scales)

    def proven_by_record(t: OutputTensor) -> bool:
        return contract.is_e8m0_scale(t.name, t.dtype, False)

    ranges, wanted, offset = [], set(), len(shard.header)
    for t in shard.tensors:
        if context.rehash or (scanned(t) and not proven_by_record(t)):
            ranges.append((t.name, offset, offset + t.nbytes))
            wanted.add(t.name)
        offset += t.nbytes
    if not ranges:
        return None
    by_name = {t.name: t for t in shard.tensors}
    try:
        hashes, scans = crc32_of_ranges(
            path, ranges, context.stop, context.events.on_bytes, lambda n: scanned(by_name[n])
        )
    except ShortRead:
        return "the file is truncated"
    except OSError:
        return "the file cannot be read"
    recorded = record.tensors if context.rehash else {n: record.tensors.get(n) for n in wanted}
    if hashes != recorded:
        return "its data differ from the recorded checksums"
    if any(scan.count for scan in scans.values()):
        return "its scales hold NaN (0xFF)"
    return None


class _Either(threading.Event):
    """A stop flag for one shard's hasher: set by the run's flag or by the shard's failure."""

    def __init__(self, run_stop: threading.Event) -> None:
        super().__init__()
        self.run_stop = run_stop

    def is_set(self) -> bool:
        return super().is_set() or self.run_stop.is_set()


def write_shard(shard: OutputShard, context: ShardContext) -> ShardRecord | None:
    """Write one shard; None if its scales hold NaN (then it is neither kept nor recorded)."""
    sources, events = context.sources, context.events
    tmp = context.tmp_dir / f"{shard.name}.partial"
    fd = fsio.create_fresh(tmp)  # never through a link planted in the state folder
    hashes: dict[str, Crc32] = {}
    scans: list[tuple[Piece, ScaleScan]] = []  # one per source tensor: a NaN is named there
    try:
        os.fchmod(fd, 0o644)
        _reserve(fd, shard.file_size)
        write_all(fd, memoryview(shard.header))
        faults.fault_point("shard.header")
        if events.on_bytes:
            events.on_bytes(len(shard.header))
        feeds = []
        for tensor in shard.tensors:
            h = hashes[tensor.name] = Crc32()
            scan = contract.is_e8m0_scale(tensor.name, tensor.dtype, context.check_scales)
            for p in tensor.pieces:  # feeds run in order: the CRC sees the pieces in turn
                targets: tuple = (h,)
                if scan:
                    scans.append((p, ScaleScan()))
                    targets = (h, scans[-1][1])
                feeds.append((targets, [(sources.fd(p.file), p.offset, p.length, p.file)]))
        stop_hasher = _Either(context.stop)
        hasher = RangeHasher(feeds, stop_hasher)  # checksums computed beside the copy
        try:
            for tensor in shard.tensors:
                for piece in tensor.pieces:
                    copy_range(
                        sources.fd(piece.file),
                        piece.offset,
                        piece.length,
                        fd,
                        context.stop,
                        events.on_bytes,
                        piece.file,
                    )
                    faults.fault_point("shard.piece")  # between the w3 and w1 halves of a w31
        except BaseException:
            stop_hasher.set()
            hasher.join()  # not finish(): its Interrupted must not mask the copy's own error
            raise
        hasher.finish()
        os.fsync(fd)
        faults.fault_point("shard.fsynced")
    except ShortRead as exc:
        tmp.unlink(missing_ok=True)
        raise SourceChanged(exc.file, f"ended early at byte {exc.offset} (truncated?)") from None
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.filename is None:  # write(2) and fsync(2) errors name no file: this one
            exc.filename = str(context.out_dir / shard.name)
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    nan = [scale_nan_problem(piece, scan, shard.name) for piece, scan in scans if scan.count]
    if nan:
        # Not marked done: a rerun must find the NaN scales again.
        tmp.unlink(missing_ok=True)
        for p in nan:
            if events.on_scale_nan:
                events.on_scale_nan(p)
        return None
    # Nothing derived from a source file that changed under us may be marked done.
    try:
        sources.check_unchanged(shard.input_files)
    except SourceChanged:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, context.out_dir / shard.name)
    fsio.fsync_dir(context.out_dir)
    faults.fault_point("shard.renamed")
    return ShardRecord(
        shard=shard.name,
        size=shard.file_size,
        header_sha256=sha256_bytes(shard.header),
        tensors={name: h.hexdigest() for name, h in hashes.items()},
        sources=sources.fingerprint(shard.input_files),
    )


def scale_nan_problem(piece: Piece, scan: ScaleScan, output: str) -> Problem:
    """NaN scale bytes, named where they are: the source file and source tensor that hold
    them and the byte within that tensor (a piece is one whole source tensor), never the
    output shard or the fused tensor they were being copied into (named beside, as facts)."""
    return problem(
        Code.SCALE_NAN,
        rule="source",
        file=piece.file,
        tensor=piece.tensor,
        count=scan.count,
        first=scan.first,
        at=piece.offset + (scan.first or 0),
        output=output,
    )


def _reserve(fd: int, size: int) -> None:
    """Reserve the shard's space so a full disk fails before any data is written."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in SPACE_ERRNOS:
            raise
        # EINVAL/EOPNOTSUPP: the filesystem cannot preallocate; writing still works.
