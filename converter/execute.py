"""Execute a plan: write output shards in parallel, atomically, resumably.

Each shard is written to a temporary name under the state directory, space-reserved up
front, streamed (header, then each tensor's source byte ranges), fsynced, checked against
the source fingerprints taken before the run, renamed into place, and only then recorded in
the ledger. Threads, not processes: every hot call (pread, write, fsync, crc32) releases the
GIL, and a thread pool shares the stop flag and open source files for free.
"""

from __future__ import annotations

import errno
import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from . import faults
from .errors import ConvertError, Problem
from .ledger import Ledger
from .plan import OutputShard
from .streaming import (
    CHUNK_SIZE,
    HashPipe,
    Interrupted,
    RangeHasher,
    ScaleScan,
    SourceChanged,
    _write_all,
    copy_range,
    hash_tensors,
    new_hash,
)

SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def file_identity(path: Path) -> tuple[int, int, int]:
    st = os.stat(path)
    return (st.st_size, st.st_mtime_ns, st.st_ino)


class SourceFiles:
    """Open source shards once, shared by all workers (pread is positional, thread-safe)."""

    def __init__(self, root: Path, files: list[str],
                 header_sha256: dict[str, str] | None = None) -> None:  # fmt: skip
        self.root = root
        self.identity = {f: file_identity(root / f) for f in files}
        # The headers the plan was made from: a file rewritten between planning and this
        # snapshot (same size, new layout) would otherwise be copied with stale offsets.
        self.header_sha256 = header_sha256 or {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, file: str) -> int:
        with self._lock:
            if file not in self._fds:
                fd = os.open(self.root / file, os.O_RDONLY)
                if os.fstat(fd).st_ino != self.identity[file][2]:
                    os.close(fd)
                    raise SourceChanged(file, "was replaced since the run started")
                want = self.header_sha256.get(file)
                if want and _header_sha256(fd) != want:
                    os.close(fd)
                    raise SourceChanged(file, "changed since it was planned (header differs)")
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
                self._fds[file] = fd
            return self._fds[file]

    def check_unchanged(self, files: list[str]) -> None:
        for file in files:
            try:
                now = file_identity(self.root / file)
            except OSError:
                raise SourceChanged(file, "disappeared during the run") from None
            if now != self.identity[file]:
                raise SourceChanged(
                    file, "changed during the run (size, modification time or inode differ)"
                )

    def fingerprint(self, files: list[str]) -> dict[str, list[int]]:
        """What a ledger entry records about the source files a shard was copied from."""
        return {f: list(self.identity[f]) for f in files}

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _header_sha256(fd: int) -> str:
    """sha256 of a safetensors header as `read_header` hashes it (bytes after the length)."""
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        return ""
    length = min(int.from_bytes(prefix, "little"), 100_000_000)
    return hashlib.sha256(os.pread(fd, length, 8)).hexdigest()


@dataclass
class Hooks:
    """Callbacks for progress; all optional and called from worker threads."""

    on_bytes: Callable[[int], None] | None = None
    on_shard: Callable[[str, bool], None] | None = None  # (name, reused)
    on_scale_nan: Callable[[Problem], None] | None = None


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _either(threading.Event):
    """A stop flag for one shard's hasher: set by the run's flag or by the shard's failure."""

    def __init__(self, run_stop: threading.Event) -> None:
        super().__init__()
        self.run_stop = run_stop

    def is_set(self) -> bool:
        return super().is_set() or self.run_stop.is_set()


def write_shard(
    shard: OutputShard,
    sources: SourceFiles,
    out_dir: Path,
    tmp_dir: Path,
    stop: threading.Event,
    hooks: Hooks,
    check_scales: bool = False,
) -> dict | None:
    """Write one shard; None if its scales hold NaN (then it is neither kept nor recorded)."""
    tmp = tmp_dir / f"{shard.name}.partial"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    hashes = {}
    scans: dict[str, ScaleScan] = {}
    try:
        os.fchmod(fd, 0o644)
        _reserve(fd, shard.file_size, shard.name)
        _write_all(fd, memoryview(shard.header))
        faults.fault_point("shard.header")
        if hooks.on_bytes:
            hooks.on_bytes(len(shard.header))
        jobs = []
        for tensor in shard.tensors:
            h = new_hash()
            targets: tuple = (h,)
            if check_scales and tensor.name.endswith("weight_scale"):
                scans[tensor.name] = ScaleScan()
                targets = (h, scans[tensor.name])
            hashes[tensor.name] = h
            ranges = [(sources.fd(p.file), p.offset, p.length, p.file) for p in tensor.pieces]
            jobs.append((targets, ranges))
        stop_hasher = _either(stop)
        hasher = RangeHasher(jobs, stop_hasher)  # checksums computed beside the copy, not after it
        try:
            for tensor in shard.tensors:
                for piece in tensor.pieces:
                    copy_range(sources.fd(piece.file), piece.offset, piece.length, fd, stop,
                               hooks.on_bytes, piece.file)  # fmt: skip
                    faults.fault_point("shard.piece")  # between the w3 and w1 halves of a w31
        except BaseException:
            stop_hasher.set()
            hasher.join()  # not finish(): its Interrupted must not mask the copy's own error
            raise
        hasher.finish()
        os.fsync(fd)
        faults.fault_point("shard.fsynced")
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        if exc.errno in SPACE_ERRNOS:
            raise _no_space(shard, out_dir) from None
        raise
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    nan = [_nan_problem(name, shard.name, scan) for name, scan in scans.items() if scan.count]
    if nan:
        # Not marked done: a rerun with --check-scales must find the NaN scales again.
        tmp.unlink(missing_ok=True)
        for problem in nan:
            if hooks.on_scale_nan:
                hooks.on_scale_nan(problem)
        return None
    # Nothing derived from a source file that changed under us may be marked done.
    try:
        sources.check_unchanged(shard.source_files)
    except SourceChanged:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, out_dir / shard.name)
    fsync_dir(out_dir)
    faults.fault_point("shard.renamed")
    return {
        "shard": shard.name,
        "sources": sources.fingerprint(shard.source_files),
        "size": shard.file_size,
        "header_sha256": _sha(shard.header),
        "tensors": {name: h.hexdigest() for name, h in hashes.items()},
    }


def _nan_problem(tensor: str, file: str, scan: ScaleScan) -> Problem:
    return Problem(
        f"{scan.count} E8M0 scale byte(s) are 0xFF (NaN); first at byte {scan.first} of the tensor",
        file=file, tensor=tensor, expected="no 0xFF scale bytes", found=f"{scan.count}",
    )  # fmt: skip


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _reserve(fd: int, size: int, name: str) -> None:
    """Reserve the shard's space so a full disk fails before any data is written."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in SPACE_ERRNOS:
            raise
        # EINVAL/EOPNOTSUPP: the filesystem cannot preallocate; writing still works.


def _no_space(shard: OutputShard, out_dir: Path) -> ConvertError:
    import shutil

    free = shutil.disk_usage(out_dir).free
    return ConvertError(
        [Problem("no space left on the device (or file size limit reached) while writing",
                 file=str(out_dir / shard.name), expected=f"{shard.file_size} bytes free",
                 found=f"{free} bytes free")],
        hint="free some space, then rerun the same command: finished shards are kept",
    )  # fmt: skip


def shard_still_valid(shard: OutputShard, entry: dict, out_dir: Path, stop: threading.Event,
                      hooks: Hooks) -> bool:  # fmt: skip
    """A ledger entry is only trusted if the file on disk still hashes to it."""
    path = out_dir / shard.name
    try:
        if path.stat().st_size != shard.file_size or entry.get("size") != shard.file_size:
            return False
        with open(path, "rb") as fh:
            if fh.read(len(shard.header)) != shard.header:
                return False
    except OSError:
        return False
    ranges, offset = [], len(shard.header)
    for t in shard.tensors:
        ranges.append((t.name, offset, offset + t.nbytes))
        offset += t.nbytes
    pipe = HashPipe(CHUNK_SIZE)
    try:
        hashes, _ = hash_tensors(str(path), ranges, pipe, stop, hooks.on_bytes)
    finally:
        pipe.close()
    return hashes == entry.get("tensors")


def run_shards(
    shards: list[OutputShard],
    sources: SourceFiles,
    out_dir: Path,
    tmp_dir: Path,
    ledger: Ledger,
    workers: int,
    stop: threading.Event,
    hooks: Hooks,
    check_scales: bool = False,
) -> dict[str, str]:
    """Write (or re-check) every shard; returns shard -> 'written' | 'reused'."""
    outcome: dict[str, str] = {}

    def task(shard: OutputShard) -> None:
        entry = ledger.done.get(shard.name)
        # A shard is only kept if its source files are the very files it was copied from:
        # a source rewritten between runs (same header, new data) must not leak old bytes.
        if (
            entry is not None
            and entry.get("sources") == sources.fingerprint(shard.source_files)
            and shard_still_valid(shard, entry, out_dir, stop, hooks)
        ):
            outcome[shard.name] = "reused"
            if hooks.on_shard:
                hooks.on_shard(shard.name, True)
            return
        ledger.forget(shard.name)
        entry = write_shard(shard, sources, out_dir, tmp_dir, stop, hooks, check_scales)
        if entry is None:
            outcome[shard.name] = "rejected"
            return
        ledger.record(entry)
        outcome[shard.name] = "written"
        if hooks.on_shard:
            hooks.on_shard(shard.name, False)

    # Largest first keeps the tail short when shards differ in size.
    order = sorted(shards, key=lambda s: -s.file_size)
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="shard") as pool:
        futures = [pool.submit(task, s) for s in order]
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                stop.set()
                wait(futures)
                errors = [f.exception() for f in futures if f.exception() is not None]
                real = [e for e in errors if not isinstance(e, Interrupted)]
                raise (real or errors)[0]
        except KeyboardInterrupt:
            stop.set()
            wait(futures)
            raise
    return outcome
