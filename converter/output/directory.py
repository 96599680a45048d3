"""The output directory: its layout, who may write in it, and when it is complete.

Only this module spells the names inside an output directory. While a run is in progress
the directory holds a state folder `.kimi_w31/`: the lock, the ledger (one fsynced line per
finished shard), a journal of every other file the run writes, and the temporaries. A
complete output holds the shards, the source's other files, `kimi_w31.checksums.json`
(the ledger of record: every file and every tensor checksum, and each shard's source
identity), `config.json` and, written last, the index; the state folder is then removed.
A run holds the directory from `OutputDir.claim` to the end of a `with` block of its
`session.Session`: every step it takes there goes through it, and leaving it releases the lock.

Rules that keep the promise "never a wrong, stale or incomplete output that looks complete":
- the index is removed before anything in the directory changes, and written last;
- "complete" is proven, never remembered: a rerun seeds its ledger from the checksums file
  and every shard is proven again before it is kept (`execute.shard.settle`);
- files "we wrote" are the files this tool's own records name, with the size they had; a
  directory holding anything else is never cleared (`--force` refuses) and never finalized.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, NoReturn

from .. import contract, faults, fsio
from ..contract import CHECKSUMS_NAME, CONFIG_NAME, INDEX_NAME, STATE_DIR
from ..errors import Fatal, fatal, problem
from ..hashing import CHUNK_SIZE, sha256_file, shard_header_sha256
from ..reasons import Code
from ..source import SourceId
from ..text import plural
from .lock import LockRefused, OutputLock
from .records import FinalFile, Ledger, Mode, PartialDownloads, ShardRecord
from .session import Session

_LOCK, _LEDGER, _JOURNAL, _TMP = "lock", "ledger.jsonl", "journal.jsonl", "tmp"
_PARTIALS = "partials.jsonl"  # partial downloads a Hub run started (outside this directory)
_FAULT_LABELS = {
    CHECKSUMS_NAME: "finalize.checksums",
    CONFIG_NAME: "finalize.config",
    INDEX_NAME: "finalize.index",
}
SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
PERMISSION_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS}


@dataclass(frozen=True)
class Standing:
    """What stands at the output path, seen without following links: the facts every
    refusal before a write is judged on (`Survey.refusal`)."""

    root: Path
    state_path: Path
    root_is_other: bool  # the output path is there and is not a directory
    state: str | None  # what the state folder is (`fsio.lkind`; None: nothing)
    state_shown: str  # the same, in words a user can act on
    base: Path  # the state folder, or its closest folder that exists
    base_is_dir: bool
    base_shown: str
    base_writable: bool
    lock_shown: str  # what stands where the lock is (a refused lock is worded with it)
    # The room on the filesystems the run writes on, for a dry run to judge: the output's
    # (None where `base` is not a directory: refused first), and that of the folder the run
    # writes beside it (an executor's downloads; None: none).
    space: fsio.Space | None
    beside: fsio.Space | None


@dataclass(frozen=True)
class Survey:
    """The output directory read at once (`OutputDir.survey`): what stands there and what
    this tool's own records in it say. Every decision about the directory (may it be
    written, its mode, whose it is, which files are ours) is made from one reading, not
    from paths probed and files re-read step by step."""

    standing: Standing

    ledger_head: dict  # the ledger's first line: plan fingerprint and source key
    ledger: dict[str, ShardRecord]  # shards an unfinished run recorded
    checksums: dict  # the checksums file of a finished run ({} if none)
    checksums_size: int | None  # its size, where it is a regular file
    journal: list[dict]  # every other file a run recorded before writing it
    config: object  # config.json, parsed (None if none)
    index: bool  # whether an index is there (it marks a complete output)
    entries: list[Path]  # what the directory holds, less what is never part of a checkpoint
    files: dict[Path, int | None]  # every file under `entries`, its size where regular
    unlisted: OSError | None  # why the directory could not be listed (None: it was)
    partials: list[Path]  # partial downloads a run recorded starting (`PartialDownloads`)

    def refusal(self, mode: Mode | None = None, force: bool = False) -> Fatal | None:
        """Why a run must not write here, before anything is written (and in --dry-run
        alike): not a directory, a state folder that is not a real directory (a link would
        lead writes and deletions elsewhere), no write permission, or the conversion of
        another source without --force. None: nothing in the way."""
        where = self.standing
        if where.root_is_other:
            return fatal(Code.OUTPUT_NOT_DIRECTORY, rule="exists", file=where.root)
        if where.state not in (None, "directory"):
            return fatal(
                Code.STATE_FOLDER_INVALID,
                rule="state",
                file=where.state_path,
                state=STATE_DIR,
                kind=where.state_shown,
            )
        if not where.base_is_dir:
            return fatal(
                Code.OUTPUT_NOT_DIRECTORY, rule="folder", file=where.base, kind=where.base_shown
            )
        if not where.base_writable:
            return fatal(Code.PERMISSION_DENIED, rule="folder", file=where.base)
        if mode is Mode.OTHER_SOURCE and not force:
            return fatal(
                Code.OUTPUT_OF_ANOTHER_SOURCE, file=where.root, owner=self.owner() or "unknown"
            )
        return None

    def lock_refusal(self, refused: LockRefused) -> Fatal:
        """Why the lock was not ours, worded from this survey (read after the refusal)."""
        where = self.standing
        shown = where.state_shown if refused.why == "not-a-folder" else where.lock_shown
        return refused.worded(where.state_path / _LOCK, shown)

    def room_refusal(self, foreign: list[Path], force: bool) -> Fatal | None:
        """Why a fresh run must not clear the directory: anything there without --force,
        or, with it, files our records do not name (`foreign`). None: it may."""
        root = self.standing.root
        if not force:
            hint = (
                "pass --force to replace the files kimi-convert wrote there, or choose "
                "another directory"
                if not foreign
                else "choose another directory: "
                "this one holds files kimi-convert has no record of writing"
            )
            owner = self.owner()
            if owner:
                return fatal(
                    Code.OUTPUT_NOT_EMPTY, rule="convert-owned", file=root, owner=owner, hint=hint
                )
            return fatal(Code.OUTPUT_NOT_EMPTY, rule="convert", file=root, hint=hint)
        if foreign:
            shown = ", ".join(str(p.relative_to(root)) for p in foreign[:5])
            more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
            return fatal(Code.FOREIGN_OUTPUT, rule="force", file=root, files=shown + more)
        return None

    def previous(self, fingerprint: str, source: SourceId) -> tuple[Mode, dict[str, ShardRecord]]:
        """What an earlier run of this plan left: its mode and shard records. A run of this
        plan from another source is `Mode.OTHER_SOURCE` (`owner` says whose it is)."""
        head = self.ledger_head
        if head.get("fingerprint") == fingerprint:
            if head.get("source") == source.key:
                return Mode.RESUME, self.ledger
            return Mode.OTHER_SOURCE, {}
        if self.checksums.get("plan_fingerprint") == fingerprint and self.index:
            mine = self.checksums.get("source")
            if isinstance(mine, dict) and mine.get("sha256") == source.digest:
                return Mode.RECHECK, _records_of(self.checksums)
            return Mode.OTHER_SOURCE, {}
        return Mode.FRESH, {}

    def owner(self) -> str | None:
        """Whose conversion the directory holds, in words (None if it holds none we know)."""
        head = self.ledger_head
        if isinstance(head.get("source"), str) and head["source"]:
            return f"{head['source']} (an unfinished conversion)"
        config = self.config
        block = contract.find_block(config) if isinstance(config, dict) else None
        src = block.get("source") if isinstance(block, dict) else None
        name = src.get("path") if isinstance(src, dict) else None
        return f"{name!r} (a finished conversion)" if isinstance(name, str) else None

    def ours(self) -> dict[str, tuple[int, str | None, str | None]]:
        """name -> (size, header sha256 for shards, sha256 for other files where recorded) of
        every file our records say we wrote."""
        names: dict[str, tuple[int, str | None, str | None]] = {}
        files = self.checksums.get("files") if self.checksums.get("format_version") else None
        if isinstance(files, dict):
            for name, entry in files.items():
                if isinstance(entry, dict) and type(entry.get("size")) is int:
                    sha = entry.get("sha256")
                    names[name] = (
                        entry["size"],
                        entry.get("header_sha256"),
                        sha if isinstance(sha, str) else None,
                    )
            if self.checksums_size is not None:
                names[CHECKSUMS_NAME] = (self.checksums_size, None, None)
        for record in self.ledger.values():
            names[record.shard] = (record.size, record.header_sha256, None)
        for entry in self.journal:
            if isinstance(entry.get("file"), str) and type(entry.get("size")) is int:
                names[entry["file"]] = (entry["size"], None, None)
        return names


@dataclass(frozen=True)
class _Room:
    """What a fresh run removes to make room (`OutputDir._room`): the journal lines that
    record the files first, the files in the order they go, then the folders that held them."""

    journal: bytes = b""
    files: list[Path] = field(default_factory=list)
    folders: list[Path] = field(default_factory=list)


class Decision(NamedTuple):
    """What a run of this plan does here (`OutputDir.resume_decision`), and what stood there."""

    mode: Mode
    records: dict[str, ShardRecord]  # shards to prove before keeping them
    standing: Standing


class OutputDir:
    def __init__(self, root: Path, beside: Path | None = None) -> None:
        """`beside`: the folder outside the directory that the run writes in too (an
        executor's downloads), whose room is surveyed with the directory's."""
        self.root = Path(os.path.realpath(root.expanduser()))  # a link loop: no exception
        self.beside = beside
        self.state = self.root / STATE_DIR
        self.tmp = self.state / _TMP
        self.lock_path = self.state / _LOCK
        self.ledger_path = self.state / _LEDGER
        self.journal_path = self.state / _JOURNAL
        self.partials_path = self.state / _PARTIALS
        self.index = self.root / INDEX_NAME
        self.checksums = self.root / CHECKSUMS_NAME
        self.ledger: Ledger | None = None
        self._lock: OutputLock | None = None
        self._created: list[Path] = []
        self._writing = False
        self._state_made = False  # the state folder is there, a real directory, this run's
        self._write_lock = threading.Lock()
        self.warnings: list[str] = []

    # -- reading, no lock needed ---------------------------------------------------------
    def survey(self) -> Survey:
        """What stands at the output path, what the directory holds and every record of
        ours there, read together (links never followed); nothing is judged here."""
        ledger, checksums, journal, config, partials = (
            fsio.read_if_regular(p)
            for p in (
                self.ledger_path,
                self.checksums,
                self.journal_path,
                self.root / CONFIG_NAME,
                self.partials_path,
            )
        )
        entries: list[Path] = []
        files: dict[Path, int | None] = {}
        unlisted = None
        try:
            # Less the hidden paths, never part of a checkpoint (the state folder, git's
            # files, huggingface_hub's `.cache/huggingface/`): neither ours to remove nor in
            # the way, so a clone of an empty model repo is an empty output directory.
            if fsio.is_real_dir(self.root):
                entries, files = fsio.listing(self.root, contract.not_part_of_checkpoint)
        except OSError as exc:  # judged where a listing is needed (`_room`)
            unlisted = exc
        base = fsio.nearest_existing(self.state)
        base_is_dir = os.path.isdir(base)
        standing = Standing(
            self.root,
            self.state,
            os.path.lexists(self.root) and not os.path.isdir(self.root),
            fsio.lkind(self.state),
            fsio.describe(self.state),
            base,
            base_is_dir,
            fsio.describe(base),
            os.access(base, os.W_OK | os.X_OK),
            fsio.describe(self.lock_path),
            fsio.space(base) if base_is_dir else None,
            # Unreadable: None (the run's own check, made then, says why).
            fsio.space_if_readable(self.beside) if self.beside is not None else None,
        )
        head, records = Ledger.parse(ledger)
        return Survey(
            standing,
            head,
            records,
            _json_object(checksums) or {},
            len(checksums) if checksums is not None else None,
            _json_lines(journal),
            _json_object(config),
            os.path.lexists(self.index),
            entries,
            files,
            unlisted,
            [Path(e["path"]) for e in _json_lines(partials) if isinstance(e.get("path"), str)],
        )

    def resume_decision(self, fingerprint: str, source: SourceId, force: bool) -> Decision:
        """What a run of this plan does here (a run and `--dry-run` alike): the mode and the
        records of shards to prove before keeping them, with what stood there (a dry run
        judges the room from it); refuses what it must refuse. The conversion of another
        source is replaced (with --force only), as a fresh run."""
        mode, records, found = self._decide(fingerprint, source, force)
        return Decision(mode, records, found.standing)

    def _decide(
        self, fingerprint: str, source: SourceId, force: bool, refused: LockRefused | None = None
    ) -> tuple[Mode, dict[str, ShardRecord], Survey]:
        """`resume_decision`, with the survey it was made from; a refused lock (`refused`)
        is the first refusal, worded from the same survey."""
        found = self.survey()
        mode, records = found.previous(fingerprint, source)
        refusal = found.lock_refusal(refused) if refused else found.refusal(mode, force)
        if refusal is not None:
            raise refusal
        return (Mode.FRESH if mode is Mode.OTHER_SOURCE else mode), records, found

    # -- claiming --------------------------------------------------------------------------
    def claim(
        self,
        fingerprint: str,
        force: bool,
        source: SourceId | None = None,
        shards: Mapping[str, int] | None = None,
        prepare: Callable[[PartialDownloads], None] | None = None,
    ) -> Session:
        """Take the lock, make the directory this run's (or refuse), let `prepare` (the
        executor) free what it may, then check there is room for the `shards` (name -> size,
        in plan order) not finished yet. Returns the run's `Session` (its mode, the ledger
        its shards are committed to): use it in a `with` block. A failure here abandons the
        claim (`give_up`)."""
        source = source or SourceId("", "")
        try:
            return self._claim(fingerprint, force, source, shards or {}, prepare)
        except BaseException as exc:
            self.give_up(exc)

    def _claim(
        self,
        fingerprint: str,
        force: bool,
        source: SourceId,
        shards: Mapping[str, int],
        prepare: Callable[[PartialDownloads], None] | None,
    ) -> Session:
        """Refuse, or take the lock; decide again on what is read under it; make the
        directory this run's; then measure the room it has. Nothing changes before the
        decision that allows it; the caller abandons the claim on any failure."""
        # Refused before the lock too: a refusal changes nothing, not even a stale lock.
        self.resume_decision(fingerprint, source, force)
        # The lock makes its folder where missing (the root too), then takes the lock in that
        # folder opened without following a link: one replaced since the decision is refused
        # there, and nothing is written through it.
        self._lock = OutputLock(self.lock_path)
        try:
            refused = self._lock.attempt()  # on any failure from here the caller calls `abandon`
        finally:
            self._created += self._lock.made
        if self._lock.warning:
            self.warnings.append(self._lock.warning)
        if refused is None:
            self._state_made = True
            faults.fault_point("lock.acquired")
        # Decided again on what is read under the lock (a refused lock: on what stands
        # there now, to word why); every change below is made from it.
        mode, records, found = self._decide(fingerprint, source, force, refused)
        room = self._room(force, found) if mode is Mode.FRESH else _Room()
        # One path for every mode: the ledger is rewritten (atomically) with the records just
        # read; a torn last line of an interrupted run is left behind with it.
        ledger = self.ledger = Ledger(self.ledger_path, fingerprint, source.key)
        data = ledger.seed(records.values())
        downloads = PartialDownloads(self.partials_path, found.partials)
        # Then done, in this order: a fresh run's files recorded in the journal (so --force
        # may finish the job after a crash), removed, and the state folder of another plan
        # reset; then the ledger, and fresh temporaries.
        if room.files or room.folders:
            fsio.append_durably(self.journal_path, room.journal)
            fsio.remove_all(room.files, room.folders)
            fsio.fsync_dir(self.root)
        if mode is Mode.FRESH:  # the partials are still to be removed
            fsio.empty(self.state, keep=(_LOCK, _PARTIALS))
        fsio.write_atomic(self.ledger_path, data, self.state)
        fsio.remove(self.tmp)  # temporaries of a crashed run (a link: only the link)
        self.tmp.mkdir(mode=0o755)
        faults.fault_point("ledger.opened")
        # The room is measured once the directory is this run's: after the room is made and
        # the executor freed what an earlier run left (`prepare`), for the shards not
        # finished yet.
        if prepare is not None:
            prepare(downloads)
        free = fsio.free_bytes(self.root)
        refusal = ledger.space_refusal(self.root, shards, free)
        if refusal is not None:
            raise refusal
        return Session(self, mode, ledger, source, list(shards))

    def _room(self, force: bool, found: Survey) -> _Room:
        """What a fresh run removes to make room, decided from `found`: the directory must be
        empty, or hold only files we recorded writing (removed with --force: the index first,
        as it marks an output complete, the checksums file last, as it is the record; then
        the folders that held them); refuses anything else."""
        if found.unlisted is not None:
            raise found.unlisted
        if not found.entries:
            return _Room()
        foreign = _foreign(found.files, found.ours(), self.root)
        refusal = found.room_refusal(foreign, force)
        if refusal is not None:
            raise refusal
        journal = "".join(
            json.dumps({"file": str(p.relative_to(self.root)), "size": size}) + "\n"
            for p, size in found.files.items()
        )
        last = {self.index: 0, self.checksums: 2}
        files = sorted(found.files, key=lambda p: last.get(p, 1))
        folders = [e for e in found.entries if e.is_dir() and not e.is_symlink()]
        return _Room(journal.encode(), files, folders)

    def begin_writes(self) -> None:
        """Called before the first change to the directory: it stops looking complete."""
        with self._write_lock:
            if not self._writing:
                self.index.unlink(missing_ok=True)
                fsio.fsync_dir(self.root)
                self._writing = True

    # -- finishing -------------------------------------------------------------------------
    def finalize(
        self, files: list[FinalFile], before_index: Callable[[], None] | None = None
    ) -> int:
        """Make every final file what it must be, then call `before_index` (which raises to
        stop), the index last; returns how many were (re)written. Refuses while anything
        else lies in the directory."""
        expected = {f.name for f in files} | set(self.ledger.done if self.ledger else ())
        found = self.survey()  # what stands now, and our records of it
        if found.unlisted is not None:
            raise found.unlisted
        strays = {
            p: n for p, n in found.files.items() if str(p.relative_to(self.root)) not in expected
        }
        foreign = _foreign(strays, found.ours(), self.root) if strays else []
        # Files our records say we wrote that this conversion no longer has (the source
        # dropped them): ours to remove, after the index (the output stops looking complete).
        dropped = [p for p in strays if p not in foreign]
        strays = foreign
        if strays:
            raise Fatal(
                [problem(Code.FOREIGN_OUTPUT, rule="finalize", file=p) for p in strays[:20]],
                hint="move it out of the output directory, then rerun the same "
                "command: finished shards are kept",
            )
        rewritten = 0
        if dropped:
            self.begin_writes()
            for path in dropped:
                path.unlink(missing_ok=True)
                rewritten += 1
                for folder in path.relative_to(self.root).parents[:-1]:  # now empty: gone too
                    with contextlib.suppress(OSError):
                        (self.root / folder).rmdir()
            fsio.fsync_dir(self.root)
        index = [f for f in files if f.name == INDEX_NAME]
        for group in ([f for f in files if f.name != INDEX_NAME], index):
            if group is index and before_index is not None:
                before_index()
            for f in group:
                path = self.root / f.name
                if _same_file(path, f):
                    continue
                self.begin_writes()
                self._journal(f)
                self._write_final(path, f)
                rewritten += 1
                faults.fault_point(_FAULT_LABELS.get(f.name, "finalize.extra"))
            fsio.fsync_dir(self.root)  # everything else is durable before the index appears
        return rewritten

    def _journal(self, f: FinalFile) -> None:
        """Record a file before writing it, so --force may remove it after a crash."""
        line = json.dumps({"file": f.name, "size": f.size}) + "\n"
        fsio.append_durably(self.journal_path, line.encode())

    def _write_final(self, path: Path, f: FinalFile) -> None:
        if not _inside(self.root, path):  # a symlinked folder must not lead writes elsewhere
            raise fatal(Code.LINK_ESCAPES, rule="output", file=path)
        self._created += fsio.make_dirs(path.parent)
        tmp = self.tmp / (path.name + ".partial")
        try:
            with os.fdopen(fsio.create_fresh(tmp), "wb") as out:
                if isinstance(f.content, bytes):
                    out.write(f.content)
                else:
                    digest = hashlib.sha256()
                    # streamed (bounded memory), and only from a regular file
                    with os.fdopen(fsio.open_regular(f.content), "rb") as src:
                        while chunk := src.read(CHUNK_SIZE):
                            digest.update(chunk)
                            out.write(chunk)
                    if digest.hexdigest() != f.sha256:
                        raise fatal(
                            Code.SOURCE_CHANGED,
                            rule="copy",
                            file=f.content,
                            hint=self.resume_hint("make sure nothing writes to the source"),
                        )
                out.flush()
                os.fsync(out.fileno())
            os.chmod(tmp, 0o644)
            os.replace(tmp, path)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise self.io_error(exc, path) from None
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def io_error(self, exc: OSError, path: Path | str | None = None) -> Fatal:
        """An OS error as a problem naming its file, with a hint true in the state it leaves."""
        name = path if path is not None else exc.filename
        file = None if name is None else os.fsdecode(name)
        if self._state_made and not fsio.is_real_dir(self.state):
            return fatal(
                Code.STATE_LOST, file=file, state=self.state, kind=fsio.describe(self.state)
            )
        if exc.errno in PERMISSION_ERRNOS:
            return fatal(
                Code.PERMISSION_DENIED,
                rule="write",
                file=file,
                error=exc.strerror or exc,
                hint=self.resume_hint("make the output directory writable for this user"),
            )
        if exc.errno in SPACE_ERRNOS:
            return fatal(
                Code.NO_SPACE,
                rule="device",
                file=file,
                error=os.strerror(exc.errno),
                hint=self.resume_hint("free some space"),
            )
        return fatal(
            Code.IO_ERROR,
            file=file,
            error=exc.strerror or exc,
            hint=self.resume_hint("fix the cause"),
        )

    def resume_hint(self, first: str) -> str:
        done = len(self.ledger.done) if self.ledger else 0
        kept = "it starts where it stopped"
        if done:
            kept = f"the {plural(done, 'finished shard')} {'is' if done == 1 else 'are'} kept"
        return f"{first}, then rerun the same command: {kept}"

    def release(self, finished: bool) -> None:
        """Let go of the lock; a finished run also removes its state folder."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None
        if finished and fsio.is_real_dir(self.state):  # never through a link
            shutil.rmtree(self.state, ignore_errors=True)

    def give_up(self, exc: BaseException) -> NoReturn:
        """After a failure: word it while the state it describes still holds, then
        `abandon`, then raise it."""
        error = self.io_error(exc) if isinstance(exc, OSError) else None
        self.abandon()
        if error is not None:
            raise error from None
        raise exc

    def abandon(self) -> None:
        """After a failure before anything was written: release, and remove only the folders
        this run created (an empty state folder must not look like a run in progress)."""
        self.release(finished=False)
        nothing_done = not (self.ledger and self.ledger.done) and not self._writing
        if nothing_done and self.state in self._created:
            with contextlib.suppress(OSError):
                fsio.remove(self.state)  # ours; if replaced by a link, only the link
            for path in reversed(self._created):
                if path != self.state:
                    with contextlib.suppress(OSError):
                        path.rmdir()  # only if empty


def _records_of(checksums: dict) -> dict[str, ShardRecord]:
    files = checksums.get("files")
    if not isinstance(files, dict):
        return {}
    records = {}
    for name, entry in files.items():
        if isinstance(entry, dict) and "header_sha256" in entry:
            record = ShardRecord.from_json({"shard": name, **entry})
            if record is not None:
                records[name] = record
    return records


def _foreign(
    files: Mapping[Path, int | None], recorded: Mapping[str, tuple], root: Path
) -> list[Path]:
    """The files (path -> size where regular, `fsio.listing`) that our records
    (`Survey.ours`) do not name with their current size and content digest."""
    foreign = []
    for path, size in files.items():
        want = recorded.get(str(path.relative_to(root)))
        if (
            want is None
            or size != want[0]
            or (want[1] is not None and shard_header_sha256(path) != want[1])
            or (want[2] is not None and sha256_file(path) != want[2])
        ):
            foreign.append(path)
    return foreign


def _json_lines(data: bytes | None) -> list[dict]:
    """The JSON objects of a record file's lines (a torn or edited line is no record)."""
    try:
        lines = (data or b"").decode("utf-8").splitlines()
    except ValueError:  # not UTF-8: no record
        return []
    out = []
    for line in lines:
        with contextlib.suppress(ValueError):
            value = json.loads(line)
            if isinstance(value, dict):
                out.append(value)
    return out


def _json_object(data: bytes | None) -> dict | None:
    """A record file's JSON object, or None (missing, unreadable, not an object)."""
    try:
        value = json.loads((data or b"").decode("utf-8"))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _same_file(path: Path, f: FinalFile) -> bool:
    try:
        if not fsio.is_regular(path, follow=False) or path.stat().st_size != f.size:
            return False
        return sha256_file(path) == f.sha256
    except OSError:
        return False


def _inside(root: Path, path: Path) -> bool:
    parent = Path(os.path.realpath(path.parent))  # never raises on a link loop
    return parent == root or root in parent.parents
