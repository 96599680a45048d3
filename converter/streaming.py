"""Bounded-memory byte streaming with hashing overlapped on a helper thread.

Why our own loop: the safetensors library has no streaming writer, and copying through a
reusable buffer is what lets us hash every tensor while it passes (the checksums `verify`
needs) without reading anything twice. Hashing runs on a second thread (hashlib releases
the GIL for large buffers), so reading/writing the next chunk overlaps hashing this one.
Memory per stream is `BUFFERS * CHUNK_SIZE`, whatever the tensor or shard size.
"""

from __future__ import annotations

import ctypes
import errno
import os
import queue
import threading
import zlib
from collections.abc import Callable

CHUNK_SIZE = 8 << 20
BUFFERS = 3
# Per-tensor checksum: CRC-32 (zlib, ~2.7 GB/s a core here; sha256 with SHA-NI ~1.6 GB/s).
# The checksums live next to the data, so no hash could make them tamper-proof; what they
# must do is catch accidental corruption (bad disks, torn copies), which CRC-32 does for every
# burst up to 32 bits and otherwise misses with probability 2^-32 per corrupted tensor. With
# sha256 a single stream was hash-bound below `cp` speed on a 2-core machine.
HASH_NAME = "crc32"


class Interrupted(Exception):
    """The run was asked to stop (Ctrl-C, another worker failed)."""


class SourceChanged(Exception):
    def __init__(self, file: str, detail: str) -> None:
        super().__init__(f"{file}: {detail}")
        self.file = file
        self.detail = detail


class HashPipe:
    def __init__(self, chunk_size: int = CHUNK_SIZE, buffers: int = BUFFERS) -> None:
        self.chunk_size = chunk_size
        self._free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(buffers):
            self._free.put(bytearray(chunk_size))
        self._work: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="hasher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                self._work.task_done()
                return
            targets, buf, n = item
            try:
                view = memoryview(buf)[:n]
                for target in targets:
                    target.update(view)
            except BaseException as exc:  # pragma: no cover - hashlib does not fail
                self._error = exc
            self._free.put(buf)
            self._work.task_done()

    def buffer(self) -> bytearray:
        return self._free.get()

    def give_back(self, buf: bytearray) -> None:
        self._free.put(buf)

    def submit(self, targets: tuple, buf: bytearray, n: int) -> None:
        """Feed buf[:n] to each target's `update` (hashes, scale scanners) in order."""
        self._work.put((targets, buf, n))

    def drain(self) -> None:
        self._work.join()
        if self._error:
            raise self._error

    def close(self) -> None:
        self._work.put(None)
        self._thread.join()


class Crc32:
    """CRC-32 with hashlib's update/hexdigest interface (zlib releases the GIL on big buffers)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def new_hash() -> Crc32:
    return Crc32()


def _write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]


def stream_range(
    pipe: HashPipe,
    targets: tuple,
    src_fd: int,
    offset: int,
    length: int,
    out_fd: int | None,
    stop: threading.Event | None,
    progress: Callable[[int], None] | None,
    what: str,
) -> None:
    """Read [offset, offset+length) of src_fd, feed it to `targets`, append it to out_fd."""
    end = offset + length
    while offset < end:
        if stop is not None and stop.is_set():
            raise Interrupted()
        buf = pipe.buffer()
        want = min(pipe.chunk_size, end - offset)
        try:
            n = os.preadv(src_fd, [memoryview(buf)[:want]], offset)
            if n == 0:
                raise SourceChanged(what, f"ended early at byte {offset} (file truncated?)")
            if out_fd is not None:
                _write_all(out_fd, memoryview(buf)[:n])
        except BaseException:
            pipe.give_back(buf)
            raise
        pipe.submit(targets, buf, n)
        offset += n
        if progress is not None:
            progress(n)


class ScaleScan:
    """Counts E8M0 0xFF bytes (NaN scales) and remembers the first one's byte position."""

    def __init__(self) -> None:
        self.count = 0
        self.first: int | None = None
        self._seen = 0

    def update(self, view: memoryview) -> None:
        data = view.tobytes() if not isinstance(view, bytes) else view
        found = data.count(0xFF)
        if found:
            if self.first is None:
                self.first = self._seen + data.index(0xFF)
            self.count += found
        self._seen += len(data)


def hash_tensors(
    path: str,
    ranges: list[tuple[str, int, int]],
    pipe: HashPipe,
    stop: threading.Event | None = None,
    progress: Callable[[int], None] | None = None,
    scan: Callable[[str], bool] | None = None,
) -> tuple[dict[str, str], dict[str, ScaleScan]]:
    """Hash each named [begin, end) range of a file; returns (name -> hex digest, scans).

    `scan(name)` picks the tensors whose bytes are also scanned for 0xFF scales.
    """
    hashes = {}
    scans: dict[str, ScaleScan] = {}
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for name, begin, end in ranges:
            h = new_hash()
            targets: tuple = (h,)
            if scan is not None and scan(name):
                scans[name] = ScaleScan()
                targets = (h, scans[name])
            stream_range(pipe, targets, fd, begin, end - begin, None, stop, progress, path)
            hashes[name] = h
        pipe.drain()
    finally:
        os.close(fd)
    return {name: h.hexdigest() for name, h in hashes.items()}, scans


# Kernel-side copy: the bytes go page cache -> page cache without passing through Python,
# as `cp` does. Falls back to a read/write loop where the kernel or filesystem cannot.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF}
_kernel_copy_ok = hasattr(os, "copy_file_range")
COPY_STEP = 64 << 20  # per call: keeps progress and Ctrl-C responsive


def copy_range(
    src_fd: int,
    offset: int,
    length: int,
    out_fd: int,
    stop: threading.Event | None,
    progress: Callable[[int], None] | None,
    what: str,
) -> None:
    """Append [offset, offset+length) of src_fd to out_fd (at its current position)."""
    global _kernel_copy_ok
    end = offset + length
    while offset < end:
        if stop is not None and stop.is_set():
            raise Interrupted()
        want = min(COPY_STEP, end - offset)
        n = 0
        if _kernel_copy_ok:
            try:
                n = os.copy_file_range(src_fd, out_fd, want, offset)
            except OSError as exc:
                if exc.errno not in _NO_KERNEL_COPY:
                    raise
                _kernel_copy_ok = False
        if n == 0:  # no kernel copy, or it copied nothing: a plain read/write of this step
            buf = bytearray(min(want, CHUNK_SIZE))
            n = os.preadv(src_fd, [buf], offset)
            if n == 0:
                raise SourceChanged(what, f"ended early at byte {offset} (file truncated?)")
            _write_all(out_fd, memoryview(buf)[:n])
        offset += n
        start_writeback(out_fd)
        if progress is not None:
            progress(n)


def _find_sync_file_range():
    # Python has no binding for sync_file_range(2); libc has, on Linux. Elsewhere: a no-op.
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_sync_file_range = _find_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int) -> None:
    """Start writing a file's dirty pages to disk now, without waiting for it.

    The shard's final fsync then waits only for the tail instead of for the whole shard, so
    writeback overlaps copying (as the kernel's background flusher does for `cp`).
    """
    if _sync_file_range is not None:
        _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


def hash_ranges(
    jobs: list[tuple[tuple, list[tuple[int, int, int, str]]]],
    view: memoryview,
    stop: threading.Event | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Feed each job's ranges, in order, to its targets' `update`, through `view`.

    A job is (targets, [(fd, offset, length, file name), ...]).
    """
    size = len(view)
    for targets, ranges in jobs:
        for fd, offset, length, what in ranges:
            end = offset + length
            while offset < end:
                if stop is not None and stop.is_set():
                    raise Interrupted()
                n = os.preadv(fd, [view[: min(size, end - offset)]], offset)
                if n == 0:
                    raise SourceChanged(what, f"ended early at byte {offset}")
                for target in targets:
                    target.update(view[:n])
                offset += n
                if progress is not None:
                    progress(n)


class RangeHasher(threading.Thread):
    """Hashes a shard's source ranges on its own thread while `copy_range` copies them.

    Both read the same source pages, so one of the two reads is served from the page cache;
    hashing (the only CPU-heavy part) runs beside the kernel copy instead of after it.
    Each job is (targets, [(fd, offset, length, file name), ...]); every target's `update`
    gets the job's bytes in order.
    """

    def __init__(self, jobs: list[tuple[tuple, list[tuple[int, int, int, str]]]],
                 stop: threading.Event | None) -> None:  # fmt: skip
        super().__init__(name="range-hasher", daemon=True)
        self.jobs = jobs
        self.stop = stop
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            hash_ranges(self.jobs, memoryview(bytearray(CHUNK_SIZE)), self.stop)
        except BaseException as exc:
            self.error = exc

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error
