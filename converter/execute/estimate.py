"""How long a conversion will take, said before it starts (`--dry-run`), from a measured
throughput and never from a guess: a short timed read of the source's own disk.

A conversion reads every byte it writes once (experts are concatenated, the rest copied),
so the time is about the bytes to write over the slower of reading and writing. Only the
read is measured (a dry run writes nothing); the estimate says so, and says when there is
nothing to measure (a source still on the Hub).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..text import human_size

SAMPLE_BYTES = 256 * 2**20  # enough to pass a disk's cache and readahead, ~1 s on an SSD
SAMPLE_SECONDS = 2.0  # and never longer than this
CHUNK = 16 * 2**20


@dataclass(frozen=True)
class Estimate:
    seconds: float | None  # None: nothing measured
    rate: float | None  # bytes/s the estimate rests on
    basis: str  # what it rests on, for people

    def as_json(self) -> dict:
        return {
            "estimate_seconds": None if self.seconds is None else round(self.seconds, 3),
            "estimate_rate_bytes_s": None if self.rate is None else round(self.rate),
            "estimate_basis": self.basis,
        }


def measure_read(path: Path, limit: int = SAMPLE_BYTES, budget: float = SAMPLE_SECONDS):
    """(bytes, seconds) of reading the start of `path` sequentially, up to `limit` bytes or
    `budget` seconds. The page cache is asked to drop the range first where the OS allows
    (a file read just now would otherwise report memory speed)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, limit, os.POSIX_FADV_DONTNEED)
        done, started = 0, time.perf_counter()
        while done < limit and time.perf_counter() - started < budget:
            chunk = os.read(fd, min(CHUNK, limit - done))
            if not chunk:
                break
            done += len(chunk)
        return done, time.perf_counter() - started
    finally:
        os.close(fd)


def estimate(to_write: int, root: Path, shard_files: list[str]) -> Estimate:
    """The time to write `to_write` bytes from the source at `root`, from a timed read of
    its largest shard on disk."""
    if to_write <= 0:
        return Estimate(0.0, None, "nothing to write")
    present = [root / f for f in shard_files if (root / f).is_file()]
    if not present:
        return Estimate(
            None,
            None,
            "not measured: no source shard is on disk yet (--download); the download "
            "progress lines show the network rate once it starts",
        )
    largest = max(present, key=lambda p: p.stat().st_size)
    try:
        nbytes, seconds = measure_read(largest)
    except OSError as exc:
        return Estimate(None, None, f"not measured: reading {largest.name} failed ({exc})")
    if nbytes == 0 or seconds <= 0:
        return Estimate(None, None, "not measured: the source shard read nothing")
    rate = nbytes / seconds
    return Estimate(
        to_write / rate,
        rate,
        f"source read measured at {human_size(rate)}/s over {human_size(nbytes)} of "
        f"{largest.name}; writing the output may be slower (not measured: a dry run "
        "writes nothing)",
    )
