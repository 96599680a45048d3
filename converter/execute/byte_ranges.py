"""Bounded-memory copying of byte ranges, with checksums computed beside the copy.

Why our own loop: the safetensors library has no streaming writer. The bytes go from the
source to the shard in the kernel (`copy_file_range`, as `cp` does), while a second thread
reads the same ranges (from the page cache) to checksum them, so hashing overlaps copying
instead of following it. Memory per stream is a few fixed buffers, whatever the shard size.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable

from ..hashing import CHUNK_SIZE, Interrupted, Range, ShortRead, hash_ranges

# Kernel-side copy; falls back to a read/write loop where the kernel or filesystem cannot.
_NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EBADF}
_kernel_copy_ok = hasattr(os, "copy_file_range")
COPY_STEP = 64 << 20  # per call: keeps progress and Ctrl-C responsive


def write_all(fd: int, view: memoryview) -> None:
    while view:
        written = os.write(fd, view)
        view = view[written:]


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
                raise ShortRead(what, offset)
            write_all(out_fd, memoryview(buf)[:n])
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


class RangeHasher(threading.Thread):
    """Hashes a shard's source ranges on its own thread while `copy_range` copies them.

    Both read the same source pages, so one of the two reads is served from the page cache;
    hashing (the only CPU-heavy part) runs beside the kernel copy instead of after it.
    """

    def __init__(
        self, feeds: list[tuple[tuple, list[Range]]], stop: threading.Event | None
    ) -> None:
        super().__init__(name="range-hasher", daemon=True)
        self.feeds = feeds
        self.stop = stop
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            hash_ranges(self.feeds, memoryview(bytearray(CHUNK_SIZE)), self.stop)
        except BaseException as exc:
            self.error = exc

    def finish(self) -> None:
        self.join()
        if self.error is not None:
            raise self.error
