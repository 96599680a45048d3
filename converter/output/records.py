"""What a run records: which source an output is the conversion of, each finished shard, and
the files written at finalization, with the ledger the shards are committed to.

Plain values the output directory (`outdir.py`), its session (`session.py`), the source
readers and the executors share; only the ledger touches the filesystem (one fsynced line per
finished shard).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import NamedTuple

from .. import faults, fsio
from ..errors import Fatal, fatal
from ..reasons import Code
from ..text import Size


@dataclass(frozen=True)
class ShardRecord:
    """What a finished shard was: written after it is fsynced and renamed into place."""

    shard: str
    size: int
    header_sha256: str
    tensors: dict[str, str]  # tensor -> CRC-32 of its bytes
    sources: dict[str, list]  # source file -> identity when it was copied (see SourceFiles)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: object) -> ShardRecord | None:
        """None for anything that is not a well-formed record (a torn or edited line)."""
        if not isinstance(data, dict):
            return None
        try:
            record = cls(
                data["shard"], data["size"], data["header_sha256"], data["tensors"], data["sources"]
            )
        except (KeyError, TypeError):
            return None
        ok = (
            isinstance(record.shard, str)
            and type(record.size) is int
            and isinstance(record.header_sha256, str)
            and isinstance(record.tensors, dict)
            and isinstance(record.sources, dict)
        )
        return record if ok else None


class FileIdentity(NamedTuple):
    """Which file stands at a path, from one `stat` (no byte read). A write changes the
    mtime and the ctime (which no user can set back); the device and inode make a copy
    (another node, another disk) a different file."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    device: int


def file_identity(path: str | os.PathLike[str]) -> FileIdentity | None:
    """The identity of the file a reader of `path` opens (links followed, as a loader
    follows them); None when nothing readable stands there. The one reader of identities:
    `verify` records them, the serving adapter compares them."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return FileIdentity(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)


class Mode(Enum):
    FRESH = "fresh"  # nothing of this plan was there
    RESUME = "resume"  # an interrupted run of this plan
    RECHECK = "recheck"  # a complete output of this plan: prove it again, repair what fails
    OTHER_SOURCE = "other-source"  # a run of this plan from another source: --force only


class Ledger:
    """Append-only, fsynced record of finished shards; line 1 names the plan fingerprint and
    where the source was read from (`source.SourceId.key`)."""

    def __init__(self, path: Path, fingerprint: str, source: str = "") -> None:
        self.path = path
        self.fingerprint = fingerprint
        self.source = source
        self.done: dict[str, ShardRecord] = {}
        self._lock = threading.Lock()

    @staticmethod
    def parse(data: bytes | None) -> tuple[dict, dict[str, ShardRecord]]:
        """(first line, records) of a ledger file's bytes; a torn last line is ignored."""
        try:
            lines = (data or b"").decode("utf-8").splitlines()
            head = json.loads(lines[0])
        except (ValueError, IndexError):
            return {}, {}
        records = {}
        for line in lines[1:]:
            with contextlib.suppress(ValueError):
                record = ShardRecord.from_json(json.loads(line))
                if record is not None:
                    records[record.shard] = record
        return (head if isinstance(head, dict) else {}), records

    def seed(self, records: Iterable[ShardRecord] = ()) -> bytes:
        """Start from `records`; returns the ledger file that says so, for the claim to
        write (atomically) once the directory is this run's."""
        self.done = {r.shard: r for r in records}
        lines = [json.dumps({"fingerprint": self.fingerprint, "source": self.source})]
        lines += [json.dumps(r.to_json(), separators=(",", ":")) for r in self.done.values()]
        return ("\n".join(lines) + "\n").encode()

    def space_refusal(self, root: Path, sizes: Mapping[str, int], free: int) -> Fatal | None:
        """Why the shards not finished yet (`sizes`: name -> size) cannot fit in `free` bytes
        of `root`'s filesystem (None: they fit)."""
        return space_refusal(root, sum(n for s, n in sizes.items() if s not in self.done), free)

    def record(self, record: ShardRecord) -> None:
        with self._lock:
            faults.fault_point("ledger.append")
            line = json.dumps(record.to_json(), separators=(",", ":")) + "\n"
            fsio.append_durably(self.path, line.encode())
            faults.fault_point("ledger.appended")
            self.done[record.shard] = record

    def forget(self, shard: str) -> None:
        self.done.pop(shard, None)


@dataclass(frozen=True)
class FinalFile:
    """A file written at finalization: bytes computed in memory, or a source file copied."""

    name: str
    size: int
    sha256: str
    content: bytes | Path  # the bytes, or the source file whose bytes are copied


@dataclass(frozen=True)
class FinalFiles:
    """The files a conversion has besides its shards and its checksums file, by role."""

    extras: list[FinalFile]  # the source's other files, copied unchanged
    config: FinalFile
    index: FinalFile  # written last: a directory with an index is a complete conversion
    # Every source file besides the shards that these derive from (the config, the index,
    # each file copied: rel name -> identity when read): all proven unchanged at publish.
    derived_from: dict[str, list[int]] = field(default_factory=dict)

    def __iter__(self) -> Iterator[FinalFile]:
        """In the order the checksums file lists them."""
        return iter([*self.extras, self.config, self.index])

    def with_checksums(self, checksums: FinalFile) -> list[FinalFile]:
        """In the order they are written: the record of every file before the two that
        make the directory read as a conversion (the config, then the index)."""
        return [*self.extras, checksums, self.config, self.index]


class PartialDownloads:
    """The partial downloads a Hub run started (outside the output directory), each recorded
    (fsynced) in the state folder before it can matter: the only proof this tool has that
    such a file is its own, so that a later run, or this one, may remove it."""

    def __init__(self, path: Path, recorded: Iterable[Path] = ()) -> None:
        self.path = path
        self._paths = list(recorded)  # as the claim read them (under the lock), then noted

    def note(self, path: Path) -> None:
        line = json.dumps({"path": str(path)}) + "\n"
        fsio.append_durably(self.path, line.encode())
        self._paths.append(path)

    def recorded(self) -> list[Path]:
        """Every partial download recorded and not yet forgotten: those the claim read (no
        other run adds any while the lock is held) and those noted since."""
        return list(self._paths)

    def forget(self) -> None:
        """Called once every recorded partial download is removed."""
        self.path.unlink(missing_ok=True)
        self._paths.clear()


def space_refusal(root: Path, needed: int, free: int) -> Fatal | None:
    """Why `needed` bytes of output cannot be written to `root`'s filesystem with `free`
    bytes free (None: they fit). One rule for a run's claim and for --dry-run."""
    if needed > free:
        return fatal(Code.NO_SPACE, rule="output", file=root, need=Size(needed), free=Size(free))
    return None
