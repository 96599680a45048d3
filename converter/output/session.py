"""One run's hold on its output directory: what the claim found, the ledger every finished
shard is committed to, and the finalization (the checksums file of record, then the other
files, the index last). The directory's own steps stay with it (`outdir.py`): the session
says what the run has, and leaving it releases the lock on every path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn, Protocol

from ..contract import CHECKSUMS_FORMAT, CHECKSUMS_NAME
from ..hashing import TENSOR_HASH, sha256_bytes
from ..source import SourceId
from .records import FinalFile, FinalFiles, Ledger, Mode, ShardRecord


class Directory(Protocol):
    """What a session asks of the directory it holds (`directory.OutputDir`, which makes
    sessions in `claim`: the session does not import it)."""

    root: Path
    tmp: Path  # the temporaries, renamed into place when complete
    warnings: list[str]  # what the claim found worth saying (a stale lock)

    def begin_writes(self) -> None: ...  # before the first change: the index goes
    def resume_hint(self, first: str) -> str: ...
    def finalize(self, files: list[FinalFile], before_index: Callable[[], None] | None) -> int: ...
    def release(self, finished: bool) -> None: ...
    def give_up(self, exc: BaseException) -> NoReturn: ...


class Session:
    """One run's hold on its output directory, from a claim (`OutputDir.claim` returns it) to
    the end of a `with` block: what the claim found, the ledger the shards are committed to,
    and the finalization; the directory itself is `output`. Leaving releases the lock on
    every path: after `finalize` it also removes the state folder; after a failure it words
    the error while the state it describes still holds, then removes only the folders this
    run made."""

    def __init__(
        self,
        out: Directory,
        mode: Mode,
        ledger: Ledger,
        source: SourceId,
        shards: list[str],
    ) -> None:
        self.output = out  # its root, temporaries, warnings, steps and hints
        self.mode = mode
        self.ledger = ledger  # finished shards, of this run or an earlier one
        self.source = source
        self.shards = shards  # in plan order: the checksums file lists them so
        self.finished = False

    def finalize(self, files: FinalFiles, before_index: Callable[[], None] | None = None) -> int:
        """The checksums file of every shard (all in the ledger by now) and of `files`, then
        every final file made what it must be, `before_index` called (it raises to stop
        the publication), the index last (`OutputDir.finalize`). Returns how many were
        (re)written."""
        records = [self.ledger.done[name] for name in self.shards]
        data = checksums_document(self.ledger.fingerprint, records, list(files), self.source)
        checksums = FinalFile(CHECKSUMS_NAME, len(data), sha256_bytes(data), data)
        rewritten = self.output.finalize(files.with_checksums(checksums), before_index)
        self.finished = True
        return rewritten

    def __enter__(self) -> Session:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> None:
        if exc is not None:
            self.output.give_up(exc)
        try:
            self.output.release(finished=self.finished)
        except BaseException as late:
            self.output.give_up(late)


def checksums_document(
    fingerprint: str,
    records: list[ShardRecord],
    others: list[FinalFile],
    source: SourceId | None = None,
) -> bytes:
    """`kimi_w31.checksums.json`: every shard's record, and size + sha256 of every other file."""
    files: dict[str, dict] = {}
    for r in records:
        files[r.shard] = {
            "size": r.size,
            "header_sha256": r.header_sha256,
            "tensors": r.tensors,
            "sources": r.sources,
        }
    for f in others:
        files[f.name] = {"size": f.size, "sha256": f.sha256}
    doc = {
        "format_version": CHECKSUMS_FORMAT,
        "tensor_checksum": TENSOR_HASH,
        "plan_fingerprint": fingerprint,
        # Where the source was read from, hashed: a rerun continues only the same source's
        # conversion (`Survey.previous`); no path of this machine is published.
        "source": {"sha256": source.digest if source is not None else None},
        "files": files,
    }
    return (json.dumps(doc) + "\n").encode()
