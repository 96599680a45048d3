"""The streaming executor (`--download`): shards written as their source files arrive.

It asks of the origin only what `Remote` declares (sizes, content ids, fetch, delete, where
downloads go and how its partial downloads are named): the Hub is one such origin
(`source/hub.py`); another is one more file that implements `Remote` beside `Origin`.

Source shards are fetched in the order the plan first needs them, at most
`--max-source-window` of them live at once (downloading, or present with output shards still
waiting for them). An output shard is settled by the same core as a local run as soon as
every source shard it reads is present; with `--delete-source-shards` a source shard is
deleted once every output shard that reads it is done. Peak disk is then the output plus
the window of source shards.

Resume: records of a Hub run name source shards by content (size and the Hub's ETag, the
sha256 of an LFS file), not by inode, so an output shard whose source shards were deleted is
still proven and nothing it needed is downloaded again.

Partial downloads: a download cut short by Ctrl-C or a kill leaves the client's temporary
file behind (huggingface_hub's, for the Hub), which no later download reuses. Each one this
run starts is recorded in the output's state folder as it appears (`_DownloadWatch`), and
every recorded one is removed when the run ends, however it ends, and at the start of the
next run (after a kill).
Files nobody recorded, another process's among them, are never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol, runtime_checkable

from ..errors import Code, fatal
from ..hashing import Interrupted
from ..plan import OutputShard, Plan
from ..records import Ledger, PartialDownloads
from ..source import SourceReader
from . import DownloadProgress, Executor, OnDone
from .shard import (
    Outcome,
    ShardContext,
    ShardOutcome,
    SourceFiles,
    commit,
    file_identity,
    why_not_kept,
    write,
)

DEFAULT_WINDOW = 4
_MAX_DOWNLOADS = 4  # parallel source downloads, within the window
_WATCH_INTERVAL = 0.05  # s between looks for new partial downloads (cheap: /proc/self/fd)
_METER_INTERVAL = 0.5  # s between disk samples, so bytes still arriving are seen too
_STOP_GRACE = 2.0  # s a stopping run gives downloads to end at their next chunk


# -- the seam: what the executor asks of a remote origin -----------------------------------------


class CreatedHook(Protocol):
    """Calls back the moment the client has created a partial download (see `_DownloadWatch`)."""

    def install(self) -> None: ...

    def remove(self) -> None: ...


class Partials(Protocol):
    """The client's partial downloads: the temporary files a cut-short download leaves."""

    def open(self) -> list[Path]:
        """Those this process holds open under the storage: proof that this run made them."""
        ...

    def owns(self, path: Path) -> bool:
        """Whether `path` is a partial download of this storage."""
        ...

    def remove(self, path: Path) -> int | None:
        """Remove a recorded one; the bytes freed, None if there was nothing to remove."""
        ...

    def on_created(self, callback: Callable[[Path | None], None]) -> CreatedHook: ...


@runtime_checkable
class Remote(Protocol):
    """A resolved source whose shards are fetched during the run."""

    kind: str  # the key of this executor's block in the summary
    storage: Path  # what holds the downloads: measured for peak disk, checked for space
    partials: Partials

    def size(self, file: str) -> int: ...

    def content_id(self, file: str) -> list:
        """What a record keeps of a source shard instead of its inode (it may be deleted)."""
        ...

    def other_bytes(self) -> int:
        """The non-weight files, already downloaded while resolving."""
        ...

    def rows(self) -> list[tuple[str, str]]:
        """Which source, for the dry run's table."""
        ...

    def summary(self) -> dict:
        """Which source, for the summary."""
        ...

    def fetch(
        self,
        file: str,
        on_open: Callable[[], None],
        on_bytes: Callable[[int], None],
        stop: Callable[[], bool],
    ) -> None:
        """Download one shard (a no-op if complete). `on_open` once its temporary file exists,
        `on_bytes` per increment; `stop()` true: end at the next chunk (raise Interrupted)."""
        ...

    def delete(self, root: Path, file: str) -> None: ...


# -- the window: one model, replayed for the estimate and driven by the run ---------------------


def download_order(shards: list[OutputShard], file_order: list[str]) -> list[str]:
    """Source shards in the order the output shards first need them."""
    rank = {f: i for i, f in enumerate(file_order)}
    order: dict[str, None] = {}
    for shard in shards:
        for f in sorted(shard.input_files, key=lambda f: rank.get(f, len(rank))):
            order.setdefault(f)
    return list(order)


class Window:
    """Source shards in download order, the output shards each one feeds, and which are live
    (taken and still needed). The run and the estimate move it through the same steps:
    `take` a source shard, it `arrive`s (the output shards it completes are ready), each
    ready shard is `finish`ed (the source shards it was the last reader of are freed)."""

    def __init__(self, shards: list[OutputShard], file_order: list[str]) -> None:
        self.order = download_order(shards, file_order)
        self.queue = list(reversed(self.order))  # popped from the end: next first
        self.feeds: dict[str, set[str]] = {f: set() for f in self.order}
        for s in shards:
            for f in s.input_files:
                self.feeds[f].add(s.name)
        self._needs = {s.name: set(s.input_files) for s in shards}
        self._arrived: set[str] = set()
        self.live: set[str] = set()

    def take(self) -> str:
        f = self.queue.pop()
        self.live.add(f)
        return f

    def arrive(self, file: str) -> list[str]:
        """Output shards whose every source shard is now present (each returned once)."""
        self._arrived.add(file)
        needs, arrived = self._needs, self._arrived
        ready = [n for n in sorted(self.feeds[file]) if n in needs and needs[n] <= arrived]
        for n in ready:
            del self._needs[n]
        return ready

    def finish(self, shard: str, files: list[str]) -> list[str]:
        """Source shards `shard` was the last reader of: no longer live."""
        freed = []
        for f in files:
            self.feeds[f].discard(shard)
            if not self.feeds[f]:
                self.live.discard(f)
                freed.append(f)
        return freed


def fewest_slots(shards: list[OutputShard], file_order: list[str]) -> int:
    """Fewest live source shards with which in-order streaming never stalls: the window
    replayed one source shard at a time, each output shard finished as soon as it is ready."""
    window, files = Window(shards, file_order), {s.name: s.input_files for s in shards}
    most = 0
    while window.queue:
        f = window.take()
        most = max(most, len(window.live))
        for name in window.arrive(f):
            window.finish(name, files[name])
    return most


@dataclass
class DiskEstimate:
    min_window: int  # fewest live source shards with which in-order streaming cannot stall
    window: int
    peak_bound: int  # output + small files + the largest `window` source shards (or all)
    output_bytes: int
    source_bytes: int
    small_bytes: int


def estimate(
    shards: list[OutputShard],
    file_order: list[str],
    sizes: dict[str, int],
    small_bytes: int,
    window: int,
    delete: bool,
) -> DiskEstimate:
    """Window feasibility and the peak-disk bound, from the plan alone."""
    output_bytes = sum(s.file_size for s in shards)
    needed = sorted((sizes[f] for f in download_order(shards, file_order)), reverse=True)
    source_part = sum(needed[: max(window, 1)]) if delete else sum(needed)
    return DiskEstimate(
        fewest_slots(shards, file_order),
        window,
        output_bytes + small_bytes + source_part,
        output_bytes,
        sum(sizes[f] for f in file_order),
        small_bytes,
    )


# -- the source files of a streamed run ----------------------------------------------------------


class StreamedSources(SourceFiles):
    """Source shards that arrive (and may leave) during the run, from `remote`.

    `identity` is recorded when a shard lands, so a file changed under us is still caught;
    `fingerprint` (what records keep) names content instead.
    """

    def __init__(
        self, root: Path, remote: Remote, files: list[str], header_sha256: dict[str, str]
    ) -> None:
        # No file is there yet: identities are taken as shards arrive. A downloaded shard
        # must still carry the very header the plan was made from.
        super().__init__(root, [], header_sha256=header_sha256)
        self.remote = remote
        self.order = list(files)  # index order
        self.content = {f: remote.content_id(f) for f in files}

    def arrived(self, file: str) -> None:
        with self._lock:
            self.identity[file] = file_identity(self.root / file)

    def drop(self, file: str) -> None:
        with self._lock:
            fd = self._fds.pop(file, None)
            if fd is not None:
                os.close(fd)
            self.identity.pop(file, None)

    def fingerprint(self, files: list[str]) -> dict[str, list]:
        return {f: list(self.content[f]) for f in files}

    def estimate(self, shards: list[OutputShard], window: int, delete: bool) -> DiskEstimate:
        sizes = {f: self.remote.size(f) for f in self.order}
        return estimate(shards, self.order, sizes, self.remote.other_bytes(), window, delete)


def _in_daemon_thread(fn: Callable[..., None], *args: object) -> Future:
    """Run fn on a daemon thread: Ctrl-C must not wait for a multi-GB download to end."""
    fut: Future = Future()

    def run() -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=run, name="download", daemon=True).start()
    return fut


def _tree_bytes(*roots: Path) -> int:
    """Apparent size of every file under the roots (temporaries included)."""
    total = 0
    for root in roots:
        for dirpath, _, names in os.walk(root):
            for n in names:
                path = os.path.join(dirpath, n)
                try:
                    if not os.path.islink(path):
                        total += os.lstat(path).st_size
                except OSError:
                    continue
    return total


class _DownloadWatch:
    """While the run lasts: records each partial download this process opens as it appears,
    and samples disk use.

    `scan` runs the moment the client has created a temporary file (`Partials.on_created`),
    so a run killed at any time leaves no unrecorded partial download, bar one killed within
    microseconds of creating it (empty then). The polling, and `scan` when a download's
    progress bar is made (after the file is created, before a byte is written to it), are
    the fallback should the client stop naming the file there.
    """

    def __init__(
        self, partials: Partials, journal: PartialDownloads, measure: Callable[[], None]
    ) -> None:
        self.partials = partials
        self.journal = journal
        self.measure = measure
        self.noted: set[Path] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="download-watch", daemon=True)
        self._created = partials.on_created(self.scan)

    def scan(self, created: Path | None = None) -> None:
        """Record new partial downloads: `created` (one this process has just made), or
        those this process holds open."""
        with self._lock:
            found = [created] if created is not None else self.partials.open()
            for path in found:
                if path not in self.noted and self.partials.owns(path):
                    self.journal.note(path)
                    self.noted.add(path)

    def _loop(self) -> None:
        sampled = 0.0
        while not self._stop.wait(_WATCH_INTERVAL):
            try:
                self.scan()
                if time.monotonic() - sampled >= _METER_INTERVAL:
                    sampled = time.monotonic()
                    self.measure()
            except OSError:  # the state folder went away: the run reports that itself
                continue

    def start(self) -> None:
        self._created.install()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        self._created.remove()
        with contextlib.suppress(OSError):  # the state folder went away: reported elsewhere
            self.scan()  # one last look: a download may have opened its file since


# -- the executor --------------------------------------------------------------------------------


@dataclass
class Tally:
    """What the downloads did, for the summary (updated from download threads)."""

    peak_disk_measured: int = 0
    downloaded: list[str] = field(default_factory=list)  # source shards fetched in full
    deleted: list[str] = field(default_factory=list)
    downloaded_bytes: int = 0
    deleted_bytes: int = 0
    partials_removed: int = 0  # partial downloads of this or earlier runs, removed
    partial_bytes_removed: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def measure(self, *roots: Path) -> None:
        """Disk use of downloads + output right now; called at every high-water point."""
        now = _tree_bytes(*roots)
        with self.lock:
            self.peak_disk_measured = max(self.peak_disk_measured, now)

    def remove_partials(self, partials: Partials, journal: PartialDownloads) -> None:
        """Remove every partial download the journal records (none was another's), then
        forget them: at the start of a run (a killed run's) and at its end (this run's)."""
        for path in journal.recorded():
            freed = partials.remove(path)
            if freed is not None:  # None: renamed into place when it completed
                self.partials_removed += 1
                self.partial_bytes_removed += freed
        journal.forget()

    def delete(self, sources: StreamedSources, file: str) -> None:
        sources.remote.delete(sources.root, file)
        self.deleted.append(file)
        self.deleted_bytes += sources.remote.size(file)


@dataclass
class HubExecutor(Executor):
    """Streams shards from a `Remote` (the Hub's, with `--download`) through a bounded window.

    The pipeline tells it, in this order, the source (`open_sources`) and the claimed output
    (`claimed`); `run` then gets the same source back in `context.sources`.
    """

    window: int = DEFAULT_WINDOW
    delete_source_shards: bool = False
    workers: int = 1
    download_progress: DownloadProgress = field(default_factory=DownloadProgress)
    tally: Tally = field(default_factory=Tally)
    # What the pipeline tells it, in this order (a dry run stops after the first).
    _sources: StreamedSources | None = field(default=None, init=False, repr=False)
    # The claimed output: it records partial downloads.
    _journal: PartialDownloads | None = field(default=None, init=False, repr=False)

    def open_sources(
        self,
        root: Path,
        shard_files: list[str],
        header_sha256: dict[str, str],
        reader: SourceReader | None = None,
    ) -> StreamedSources:
        if not isinstance(reader, Remote):  # a wiring error: no user input leads here
            raise TypeError("streaming needs a source read from a remote origin")
        self._sources = StreamedSources(root, reader, shard_files, header_sha256)
        return self._sources

    # -- what the CLI shows: the dry run's rows, the --json block --------------------------
    def plan_rows(self, plan: Plan) -> list[tuple[str, str]]:
        from ..console import human

        sources = self._sources
        if sources is None:  # told no source: nothing to say (the protocol's default)
            return []
        est = sources.estimate(plan.shards, self.window, self.delete_source_shards)
        window = f"{est.window} shards (at least {est.min_window} needed)"
        if est.window < est.min_window:
            window = (
                f"{est.window} shards: too small, at least {est.min_window} needed (a run "
                "is refused)"
            )
        rows = [
            *sources.remote.rows(),
            (
                "source bytes (download)",
                f"{human(est.source_bytes)} in {len(sources.order)} "
                f"shards, {human(est.small_bytes)} other files",
            ),
            ("source window", window),
            (
                "peak disk (at most)",
                f"{human(est.peak_bound)} (source + output: "
                f"{human(est.source_bytes + est.output_bytes + est.small_bytes)})",
            ),
        ]
        if not self.delete_source_shards:
            rows.append(("note", "without --delete-source-shards every source shard stays"))
        return rows

    def summary(self, plan: Plan) -> dict:
        sources, t = self._sources, self.tally
        if sources is None:  # told no source: nothing to say (the protocol's default)
            return {}
        est = sources.estimate(plan.shards, self.window, self.delete_source_shards)
        return {
            sources.remote.kind: {
                **sources.remote.summary(),
                "source_bytes": est.source_bytes,
                "small_files_bytes": est.small_bytes,
                "output_bytes": est.output_bytes,
                "window": est.window,
                "min_window": est.min_window,
                "delete_source_shards": self.delete_source_shards,
                "peak_disk_bound": est.peak_bound,
                "peak_disk_measured": t.peak_disk_measured or None,
                "downloaded_files": len(t.downloaded),
                "downloaded_bytes": t.downloaded_bytes,
                "deleted_files": len(t.deleted),
                "deleted_bytes": t.deleted_bytes,
                "partial_downloads_removed": t.partials_removed,
                "partial_bytes_removed": t.partial_bytes_removed,
            }
        }

    def claimed(self, downloads: PartialDownloads) -> None:
        """The output is ours: free what an earlier run killed mid-download left (recorded
        in its state folder) before the free-space check counts it."""
        self._journal = downloads
        if self._sources is not None:
            self.tally.remove_partials(self._sources.remote.partials, downloads)

    def run(
        self, shards: list[OutputShard], context: ShardContext, ledger: Ledger, on_done: OnDone
    ) -> list[ShardOutcome]:
        sources, journal = context.sources, self._journal
        if not isinstance(sources, StreamedSources) or journal is None:  # a wiring error
            raise TypeError("run() takes the sources of open_sources(), after claimed()")
        results: list[ShardOutcome] = []
        # 1. What is already done: proven as a local run proves it, before any download.
        pending, reasons = [], {}
        for shard in shards:
            record = ledger.done.get(shard.name)
            reason = why_not_kept(shard, record, context)
            if reason is None:
                result = ShardOutcome(shard.name, Outcome.KEPT, record)
                results.append(result)
                on_done(result)
            else:
                ledger.forget(shard.name)
                pending.append(shard)
                reasons[shard.name] = reason if record is not None else None
        # 2. The window: refused before any download if too small or if it cannot fit.
        self._check_window(pending, sources)
        window = Window(pending, sources.order)
        if self.delete_source_shards:  # present but needed by nothing left: free it now
            for f in sources.order:
                if f not in window.feeds and os.path.lexists(sources.root / f):
                    self.tally.delete(sources, f)
        self._check_space(context.out_dir, pending, window.order, sources)
        # 3. Stream.
        stream = _Stream(self, pending, window, sources, context, ledger, journal, reasons, on_done)
        results += stream.run()
        return results

    def _check_window(self, pending: list[OutputShard], sources: StreamedSources) -> None:
        """Refuse, before any download, a window the pending shards' layout cannot run in."""
        need = fewest_slots(pending, sources.order)
        if pending and self.window < need:
            raise fatal(Code.WINDOW_TOO_SMALL, need=need, window=self.window)

    def _check_space(
        self, out_dir: Path, pending: list[OutputShard], order: list[str], sources: StreamedSources
    ) -> None:
        """The source window must fit beside the output (the output itself is checked too)."""
        storage, root = sources.remote.storage, sources.root
        absent = sorted(
            (sources.remote.size(f) for f in order if not os.path.lexists(root / f)), reverse=True
        )
        need = sum(absent[: self.window]) if self.delete_source_shards else sum(absent)
        free = shutil.disk_usage(storage).free
        if os.stat(storage).st_dev == os.stat(out_dir).st_dev:
            need += sum(s.file_size for s in pending)
        if need > free:
            raise fatal(Code.NO_SPACE, rule="downloads", file=storage, need=need, free=free)


class _Stream:
    """One run's moving parts: the window, the downloads and the writes in flight.

    Downloads start while the window has room; an output shard is written once its last
    source shard arrives; a source shard is freed (deleted, with --delete-source-shards)
    once its last reader is written.
    """

    def __init__(
        self,
        ex: HubExecutor,
        pending: list[OutputShard],
        window: Window,
        sources: StreamedSources,
        context: ShardContext,
        ledger: Ledger,
        journal: PartialDownloads,
        reasons: dict[str, str | None],
        on_done: OnDone,
    ) -> None:
        self.ex, self.window, self.sources, self.context = ex, window, sources, context
        self.ledger, self.journal, self.reasons, self.on_done = ledger, journal, reasons, on_done
        self.remote, self.tally = sources.remote, ex.tally
        self.by_name = {s.name: s for s in pending}
        self.missing = {f for f in window.order if not (sources.root / f).exists()}
        self.results: list[ShardOutcome] = []
        self.downloads: dict[Future, str] = {}
        self.writes: dict[Future, OutputShard] = {}
        self.watch = _DownloadWatch(self.remote.partials, journal, self.measure)
        self.pool = ThreadPoolExecutor(max_workers=max(1, ex.workers), thread_name_prefix="shard")

    def measure(self) -> None:
        self.tally.measure(self.remote.storage, self.context.out_dir)

    def run(self) -> list[ShardOutcome]:
        progress = self.ex.download_progress
        progress.download_start(sum(self.remote.size(f) for f in self.missing), len(self.missing))
        self.watch.start()
        try:
            self._start_downloads()
            while self.downloads or self.writes:
                done, _ = wait([*self.downloads, *self.writes], return_when=FIRST_COMPLETED)
                for fut in done:
                    if fut in self.downloads:
                        f = self.downloads.pop(fut)
                        fut.result()
                        self._arrived(f)
                    else:
                        shard = self.writes.pop(fut)
                        self._written(shard, fut.result())
                self._start_downloads()
                if not self.downloads and not self.writes and self.window.queue:  # pragma: no cover
                    raise RuntimeError("download schedule stalled: window too small")
        except BaseException:
            self._stop_writes()
            raise
        finally:
            self.pool.shutdown(wait=True)
            if self.downloads:  # a download blocked on the network is not waited for
                wait(list(self.downloads), timeout=_STOP_GRACE)
            self.watch.stop()
            self.tally.remove_partials(self.remote.partials, self.journal)
            self.measure()
            progress.download_stop()
        return self.results

    def _stop_writes(self) -> None:
        """Writes stop at their next chunk, downloads at their next chunk of data (the client
        then removes its temporary file itself); the caller's `finally` waits a little for
        them, then removes whatever partial downloads are left. A write's own error wins."""
        self.context.stop.set()
        for fut in self.writes:
            fut.cancel()
        wait(list(self.writes))
        errors = [f.exception() for f in self.writes if not f.cancelled()]
        real = [e for e in errors if e is not None and not isinstance(e, Interrupted)]
        if real and not isinstance(real[0], KeyboardInterrupt):
            raise real[0] from None

    def _start_downloads(self) -> None:
        window, stop = self.window, self.context.stop
        while (
            window.queue
            and len(window.live) < self.ex.window
            and len(self.downloads) < _MAX_DOWNLOADS
            and not stop.is_set()
        ):
            f = window.take()
            self.downloads[_in_daemon_thread(self._fetch, f)] = f

    def _fetch(self, file: str) -> None:
        """Download one source shard (a no-op if present); progress and partials reported."""
        stop, progress = self.context.stop, self.ex.download_progress
        if stop.is_set():
            raise Interrupted()
        reported = 0

        def on_bytes(n: int) -> None:
            nonlocal reported
            reported += n
            progress.download_advance(n)

        present = (self.sources.root / file).exists()
        self.remote.fetch(file, self.watch.scan, on_bytes, stop.is_set)
        size = self.remote.size(file)
        with self.tally.lock:
            if not present:
                self.tally.downloaded.append(file)
                self.tally.downloaded_bytes += size
        if file in self.missing:
            progress.download_file_done(file, max(size - reported, 0))

    def _arrived(self, file: str) -> None:
        self.sources.arrived(file)
        self.measure()  # a whole source shard more on disk
        for name in self.window.arrive(file):
            shard = self.by_name[name]
            self.writes[self.pool.submit(write, shard, self.context, self.reasons.get(name))] = (
                shard
            )

    def _written(self, shard: OutputShard, result: ShardOutcome) -> None:
        commit(result, self.ledger)
        self.results.append(result)
        self.on_done(result)
        self.measure()  # the high-water mark: before any source is freed
        for f in self.window.finish(shard.name, shard.input_files):
            if self.ex.delete_source_shards and result.outcome is Outcome.WRITTEN:
                self.sources.drop(f)
                self.tally.delete(self.sources, f)
