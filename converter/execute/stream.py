"""A streamed run's moving parts: the window of source shards (one model, replayed for the
dry run's estimate and driven by the run), the downloads and the writes in flight, the
watch that records partial downloads as they appear, and the tally the summary reports.

Source shards are fetched in the order the plan first needs them, at most `slots` of them
live at once (downloading, or present with output shards still waiting for them). An output
shard is settled by the same core as a local run as soon as every source shard it reads is
present; with `delete_source_shards` a source shard is deleted once every output shard that
reads it is done. What it asks of the origin is only what `remote.py` declares.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from ..hashing import Interrupted
from ..output.records import Ledger, PartialDownloads
from ..plan import OutputShard
from ..source import FetchHooks
from . import DownloadProgress, OnDone
from .remote import Partials, StreamedSources
from .shard import Outcome, ShardContext, ShardOutcome, commit, write

_MAX_DOWNLOADS = 4  # parallel source downloads, within the window
_WATCH_INTERVAL = 0.05  # s between looks for new partial downloads (cheap: /proc/self/fd)
_METER_INTERVAL = 0.5  # s between disk samples, so bytes still arriving are seen too
_STOP_GRACE = 2.0  # s a stopping run gives downloads to end at their next chunk


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


# -- the run ---------------------------------------------------------------------------------------


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


@dataclass
class Tally:
    """What the downloads did, for the summary (updated from download threads)."""

    peak_disk_measured: int = 0
    # Only what the origin actually sent: a shard linked from bytes already on disk (another
    # revision's blob) is no download.
    downloaded: list[str] = field(default_factory=list)  # source shards the origin sent
    deleted: list[str] = field(default_factory=list)  # source shards removed from the source
    downloaded_bytes: int = 0  # bytes the origin sent (net of a retry's rewind)
    deleted_bytes: int = 0  # bytes freed (what something else still links to is kept)
    shared_kept: int = 0  # deleted shards whose bytes another snapshot still links to
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
        freed = sources.remote.delete(sources.root, file)
        with self.lock:
            self.deleted.append(file)
            self.deleted_bytes += freed
            if not freed and sources.remote.size(file):
                self.shared_kept += 1


class Settings(Protocol):
    """What a stream is run with: the executor's settings and where it reports."""

    window: int  # live source shards at most
    delete_source_shards: bool
    workers: int
    download_progress: DownloadProgress
    tally: Tally


class Stream:
    """One run's moving parts: the window, the downloads and the writes in flight.

    Downloads start while the window has room; an output shard is written once its last
    source shard arrives; a source shard is freed (deleted, with --delete-source-shards)
    once its last reader is written.
    """

    def __init__(
        self,
        ex: Settings,
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

        self.remote.fetch(file, FetchHooks(self.watch.scan, on_bytes, stop.is_set))
        size = self.remote.size(file)
        with self.tally.lock:
            if reported > 0:  # counted as it arrived: a link to bytes on disk is none
                self.tally.downloaded.append(file)
                self.tally.downloaded_bytes += reported
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
