"""The checksums a converted checkpoint carries, and the one way each is computed.

Per tensor: CRC-32 (zlib, ~2.7 GB/s a core; sha256 with SHA-NI ~1.6 GB/s). The checksums
live next to the data, so no hash could make them tamper-proof; what they must do is catch
accidental corruption (bad disks, torn copies), which CRC-32 does for every burst up to 32
bits and otherwise misses with probability 2^-32 per corrupted tensor. With sha256 a single
stream was hash-bound below `cp` speed on a 2-core machine. Whole files (headers, config,
tokenizer, ...) are small and use sha256.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zlib
from collections.abc import Callable
from pathlib import Path

from .fsio import identity, open_regular

TENSOR_HASH = "crc32"
CHUNK_SIZE = 8 << 20


class Crc32:
    """CRC-32 with hashlib's update/hexdigest interface (zlib releases the GIL on big buffers)."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    """sha256 of a whole file, read in bounded chunks."""
    return sha256_identified(path)[0]


def sha256_identified(path: Path) -> tuple[str, list[int]]:
    """sha256 of a whole file and its identity (`fsio.identity`) taken from the descriptor
    hashed, before reading."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(path), "rb") as fh:  # never a FIFO or a device
        seen = identity(os.fstat(fh.fileno()))
        while chunk := fh.read(CHUNK_SIZE):
            h.update(chunk)
    return h.hexdigest(), seen


# Two header digests, on purpose: a shard's record in the checksums file hashes the first
# `data_start` bytes (length prefix included: those bytes are the shard's); a source file's
# identity hashes the JSON alone, as the header reader sees it.


def shard_header_sha256(path: Path) -> str | None:
    """sha256 of a shard's header as the checksums file records it: the 8-byte length and
    the JSON after it (the first `data_start` bytes). None if it cannot be read."""
    try:
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            length = int.from_bytes(prefix, "little")
            if len(prefix) < 8 or length > 100_000_000:
                return None
            return sha256_bytes(prefix + fh.read(length))
    except OSError:
        return None


class Interrupted(Exception):
    """The work was asked to stop (Ctrl-C, SIGTERM, another worker failed)."""


class ShortRead(Exception):
    """A file ended before a range it should hold (truncated, or changed under us)."""

    def __init__(self, file: str, offset: int) -> None:
        super().__init__(f"{file}: ended early at byte {offset}")
        self.file = file
        self.offset = offset


class ScaleScan:
    """Counts E8M0 0xFF bytes (NaN scales) and remembers the first one's byte position.

    Convert runs one beside the CRC-32 of every E8M0 scale tensor it copies (on the hasher
    thread: no extra read), verify --checksums likewise."""

    def __init__(self) -> None:
        self.count = 0
        self.first: int | None = None
        self._seen = 0

    def update(self, view) -> None:
        data = bytes(view)
        # find (memchr) first: ~6x faster than count, and a clean chunk needs nothing more.
        at = data.find(b"\xff")
        if at >= 0:
            if self.first is None:
                self.first = self._seen + at
            self.count += data.count(0xFF, at)
        self._seen += len(data)


Range = tuple[int, int, int, str]  # (fd, offset, length, file name for messages)


def hash_ranges(
    feeds: list[tuple[tuple, list[Range]]],
    view: memoryview,
    stop: threading.Event | None = None,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Pass each feed's ranges, in order, to its targets' `update`, through `view`.

    A feed is (targets, ranges): every target (a `Crc32`, a hashlib object, a `ScaleScan`)
    sees the feed's bytes in order. The one reading loop behind every checksum we compute.
    """
    size = len(view)
    for targets, ranges in feeds:
        for fd, offset, length, what in ranges:
            end = offset + length
            while offset < end:
                if stop is not None and stop.is_set():
                    raise Interrupted()
                n = os.preadv(fd, [view[: min(size, end - offset)]], offset)
                if n == 0:
                    raise ShortRead(what, offset)
                for target in targets:
                    target.update(view[:n])
                offset += n
                if progress is not None:
                    progress(n)


def crc32_of_ranges(
    path: Path,
    ranges: list[tuple[str, int, int]],
    stop: threading.Event | None = None,
    progress: Callable[[int], None] | None = None,
    scan: Callable[[str], bool] | None = None,
) -> tuple[dict[str, str], dict[str, ScaleScan]]:
    """CRC-32 of each named [begin, end) range of one file (and 0xFF scans where `scan`)."""
    feeds, hashes, scans = [], {}, {}
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        for name, begin, end in ranges:
            hashes[name] = Crc32()
            targets: tuple = (hashes[name],)
            if scan is not None and scan(name):
                scans[name] = ScaleScan()
                targets = (hashes[name], scans[name])
            feeds.append((targets, [(fd, begin, end - begin, str(path))]))
        hash_ranges(feeds, memoryview(bytearray(CHUNK_SIZE)), stop, progress)
    finally:
        os.close(fd)
    return {name: h.hexdigest() for name, h in hashes.items()}, scans


def source_header_sha256(fd: int) -> str:
    """sha256 of a source file's header JSON (after the length), as the header reader
    records it in `ShardHeader.header_sha256`; "" if the file is too short."""
    prefix = os.pread(fd, 8, 0)
    if len(prefix) < 8:
        return ""
    length = min(int.from_bytes(prefix, "little"), 100_000_000)
    return sha256_bytes(os.pread(fd, length, 8))
