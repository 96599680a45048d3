"""The Hub executor (`--download`): shards written as their source files arrive.

Source shards are fetched in the order the plan first needs them, at most
`--max-source-window` of them live at once (downloading, or present with output shards still
waiting for them). An output shard is settled by the same core as a local run as soon as
every source shard it reads is present; with `--delete-source-shards` a source shard is
deleted once every output shard that reads it is done. Peak disk is then the output plus
the window of source shards.

Resume: records of a Hub run name source shards by content (size and the Hub's ETag, the
sha256 of an LFS file), not by inode, so an output shard whose source shards were deleted is
still proven and nothing it needed is downloaded again.

Partial downloads: a download cut short by Ctrl-C or a kill leaves huggingface_hub's
temporary file behind, which no later download reuses. Each one this run starts is recorded
in the output's state folder as it appears (`_DownloadWatch`), and every recorded one is
removed when the run ends, however it ends, and at the start of the next run (after a kill).
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

from ..errors import Code, fail
from ..hashing import Interrupted
from ..outdir import Ledger, OutputDir
from ..plan import OutputShard, Plan
from ..source.hub import (
    PARTIAL_NAME,
    DownloadBar,
    HubOrigin,
    HubRepo,
    PartialCreated,
    open_partials,
    remove_partial,
)
from . import DownloadProgress, Executor, OnDone
from .shard import (
    Job,
    Outcome,
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


def download_order(shards: list[OutputShard], file_order: list[str]) -> list[str]:
    """Source shards in the order the output shards first need them."""
    rank = {f: i for i, f in enumerate(file_order)}
    order: dict[str, None] = {}
    for shard in shards:
        for f in sorted(shard.source_files, key=lambda f: rank.get(f, len(rank))):
            order.setdefault(f)
    return list(order)


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
    """Window feasibility and the peak-disk bound, from the plan alone.

    Sequential in-order streaming with eager deletion: just after source shard k arrives,
    the live set is the shards still pinned by unfinished output shards, plus k. Its
    largest size over k is the fewest window slots that never stall.
    """
    output_bytes = sum(s.file_size for s in shards)
    order = download_order(shards, file_order)
    consumers: dict[str, set[str]] = {f: set() for f in order}
    for s in shards:
        for f in s.source_files:
            consumers[f].add(s.name)
    live: set[str] = set()
    arrived: set[str] = set()
    need = {s.name: set(s.source_files) for s in shards}
    min_window = 0
    for f in order:
        live.add(f)
        arrived.add(f)
        min_window = max(min_window, len(live))
        for name in sorted(consumers[f]):
            if name in need and need[name] <= arrived:
                for g in need.pop(name):
                    consumers[g].discard(name)
        live = {g for g in live if consumers[g]}
    needed = sorted((sizes[f] for f in order), reverse=True)
    source_part = sum(needed[: max(window, 1)]) if delete else sum(needed)
    return DiskEstimate(
        min_window,
        window,
        output_bytes + small_bytes + source_part,
        output_bytes,
        sum(sizes[f] for f in file_order),
        small_bytes,
    )


class HubSourceFiles(SourceFiles):
    """Source shards that arrive (and may leave) during the run.

    `identity` is recorded when a shard lands, so a file changed under us is still caught;
    `fingerprint` (what records keep) names content instead.
    """

    def __init__(
        self, root: Path, repo: HubRepo, files: list[str], header_sha256: dict[str, str]
    ) -> None:
        # No file is there yet: identities are taken as shards arrive. A downloaded shard
        # must still carry the very header the plan was made from.
        super().__init__(root, [], header_sha256=header_sha256)
        self.content = {f: repo.files[f] for f in files}

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
        return {f: [self.content[f].size, self.content[f].etag] for f in files}


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

    `scan` runs the moment huggingface_hub has created a temporary file (`PartialCreated`),
    so a run killed at any time leaves no unrecorded partial download, bar one killed within
    microseconds of creating it (empty then). The polling, and `scan` when a download's
    progress bar is made (after the file is created, before a byte is written to it), are
    the fallback should the client stop naming the file there.
    """

    def __init__(self, storage: Path, journal: OutputDir, measure: Callable[[], None]) -> None:
        self.storage = Path(os.path.realpath(storage))  # as the kernel names open files
        self.journal = journal
        self.measure = measure
        self.noted: set[Path] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="download-watch", daemon=True)
        self._created = PartialCreated(self.scan)

    def scan(self, created: Path | None = None) -> None:
        """Record new partial downloads: `created` (one this process has just made), or
        those this process holds open."""
        with self._lock:
            found = [created] if created is not None else open_partials(self.storage)
            for path in found:
                if path not in self.noted and self._holds(path):
                    self.journal.note_partial(path)
                    self.noted.add(path)

    def _holds(self, path: Path) -> bool:
        """A partial download of this run's storage (a name the client gave, in its folder)."""
        return PARTIAL_NAME.fullmatch(path.name) is not None and path.is_relative_to(self.storage)

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
class HubExecutor(Executor):
    origin: HubOrigin
    window: int = DEFAULT_WINDOW
    delete_source_shards: bool = False
    workers: int = 1
    file_order: list[str] = field(default_factory=list)  # source shards in index order
    download_progress: DownloadProgress = field(default_factory=DownloadProgress)
    peak_disk_measured: int = 0
    downloaded: list[str] = field(default_factory=list)  # source shards fetched in full
    deleted: list[str] = field(default_factory=list)
    downloaded_bytes: int = 0
    deleted_bytes: int = 0
    partials_removed: int = 0  # partial downloads of this or earlier runs, removed
    journal: OutputDir | None = None  # the claimed output (it records partial downloads)
    partial_bytes_removed: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)  # the meter, the counters

    def source_files(
        self, root: Path, shard_files: list[str], header_sha256: dict[str, str]
    ) -> HubSourceFiles:
        assert self.origin.repo is not None
        self.file_order = list(shard_files)
        return HubSourceFiles(root, self.origin.repo, shard_files, header_sha256)

    def estimate(self, shards: list[OutputShard]) -> DiskEstimate:
        repo = self.origin.repo
        assert repo is not None
        sizes = {f: repo.files[f].size for f in self.file_order}
        small = sum(repo.files[f].size for f in self.origin.small_files)
        return estimate(
            shards, self.file_order, sizes, small, self.window, self.delete_source_shards
        )

    # -- what the CLI shows: the dry run's rows, the --json block --------------------------
    def plan_rows(self, plan: Plan) -> list[tuple[str, str]]:
        from ..console import human

        est = self.estimate(plan.shards)
        repo = self.origin.repo
        assert repo is not None
        window = f"{est.window} shards (at least {est.min_window} needed)"
        if est.window < est.min_window:
            window = (
                f"{est.window} shards: too small, at least {est.min_window} needed (a run "
                "is refused)"
            )
        rows = [
            ("Hub repo", f"{repo.repo_id} (revision {self.origin.revision or 'main'})"),
            ("commit", repo.commit),
            ("downloads to", str(self.origin.storage)),
            (
                "source bytes (download)",
                f"{human(est.source_bytes)} in {len(self.file_order)} "
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
        est = self.estimate(plan.shards)
        repo = self.origin.repo
        assert repo is not None
        return {
            "hub": {
                "repo": repo.repo_id,
                "revision": self.origin.revision,
                "commit": repo.commit,
                "download_dir": str(self.origin.storage),
                "source_bytes": est.source_bytes,
                "small_files_bytes": est.small_bytes,
                "output_bytes": est.output_bytes,
                "window": est.window,
                "min_window": est.min_window,
                "delete_source_shards": self.delete_source_shards,
                "peak_disk_bound": est.peak_bound,
                "peak_disk_measured": self.peak_disk_measured or None,
                "downloaded_files": len(self.downloaded),
                "downloaded_bytes": self.downloaded_bytes,
                "deleted_files": len(self.deleted),
                "deleted_bytes": self.deleted_bytes,
                "partial_downloads_removed": self.partials_removed,
                "partial_bytes_removed": self.partial_bytes_removed,
            }
        }

    def claimed(self, out: OutputDir) -> None:
        """The output is ours: free what an earlier run killed mid-download left (recorded
        in its state folder) before the free-space check counts it."""
        self.journal = out
        self._remove_partials(out)

    def run(
        self, shards: list[OutputShard], job: Job, ledger: Ledger, on_done: OnDone
    ) -> list[ShardOutcome]:
        sources = job.sources
        assert isinstance(sources, HubSourceFiles)
        assert self.origin.storage is not None
        root = sources.root
        journal = self.journal
        assert journal is not None, "claimed() comes first"
        results: list[ShardOutcome] = []
        # 1. What is already done: proven as a local run proves it, before any download.
        pending, reasons = [], {}
        for shard in shards:
            record = ledger.done.get(shard.name)
            reason = why_not_kept(shard, record, job)
            if reason is None:
                result = ShardOutcome(shard.name, Outcome.KEPT, record)
                results.append(result)
                on_done(result)
            else:
                ledger.forget(shard.name)
                pending.append(shard)
                reasons[shard.name] = reason if record is not None else None
        self._check_window(pending, sources)
        order = download_order(pending, self.file_order)
        consumers: dict[str, set[str]] = {f: set() for f in order}
        for s in pending:
            for f in s.source_files:
                consumers[f].add(s.name)
        by_name = {s.name: s for s in pending}
        if self.delete_source_shards:  # present but needed by nothing left: free it now
            for f in self.file_order:
                if f not in consumers and os.path.lexists(root / f):
                    self._delete(root, f)
        self._check_space(job.out_dir, pending, order, root)
        missing = {f for f in order if not (root / f).exists()}
        self.download_progress.download_start(
            sum(sources.content[f].size for f in missing), len(missing)
        )
        watch = _DownloadWatch(self.origin.storage, journal, lambda: self._measure(job.out_dir))
        watch.start()

        arrived: set[str] = set()
        submitted: set[str] = set()
        queue = list(order)
        live: set[str] = set()
        downloads: dict[Future, str] = {}
        writes: dict[Future, OutputShard] = {}
        pool = ThreadPoolExecutor(max_workers=max(1, self.workers), thread_name_prefix="shard")

        def start_downloads() -> None:
            while (
                queue
                and len(live) < self.window
                and len(downloads) < _MAX_DOWNLOADS
                and not job.stop.is_set()
            ):
                f = queue.pop(0)
                live.add(f)
                fut = _in_daemon_thread(self._get_source, root, f, f in missing, job.stop, watch)
                downloads[fut] = f

        def on_arrival(f: str) -> None:
            sources.arrived(f)
            arrived.add(f)
            self._measure(job.out_dir)  # a whole source shard more on disk
            for name in sorted(consumers[f]):
                shard = by_name[name]
                if name not in submitted and set(shard.source_files) <= arrived:
                    submitted.add(name)
                    writes[pool.submit(write, shard, job, reasons.get(name))] = shard

        def on_written(shard: OutputShard, result: ShardOutcome) -> None:
            commit(result, ledger)
            results.append(result)
            on_done(result)
            self._measure(job.out_dir)  # the high-water mark: before any source is freed
            for f in shard.source_files:
                consumers[f].discard(shard.name)
                if not consumers[f]:
                    live.discard(f)
                    if self.delete_source_shards and result.outcome is Outcome.WRITTEN:
                        sources.drop(f)
                        self._delete(root, f)

        try:
            start_downloads()
            while downloads or writes:
                done, _ = wait([*downloads, *writes], return_when=FIRST_COMPLETED)
                for fut in done:
                    if fut in downloads:
                        f = downloads.pop(fut)
                        fut.result()
                        on_arrival(f)
                    else:
                        shard = writes.pop(fut)
                        on_written(shard, fut.result())
                start_downloads()
                if not downloads and not writes and queue:  # pragma: no cover - see estimate
                    raise RuntimeError("download schedule stalled: window too small")
        except BaseException:
            # Writes stop at their next chunk, downloads at their next chunk of data (the
            # client then removes its temporary file itself); `finally` waits a little for
            # them, then removes whatever partial downloads are left.
            job.stop.set()
            for fut in writes:
                fut.cancel()
            wait(list(writes))
            errors = [f.exception() for f in writes if not f.cancelled()]
            real = [e for e in errors if e is not None and not isinstance(e, Interrupted)]
            if real and not isinstance(real[0], KeyboardInterrupt):
                raise real[0] from None
            raise
        finally:
            pool.shutdown(wait=True)
            if downloads:  # a download blocked on the network is not waited for
                wait(list(downloads), timeout=_STOP_GRACE)
            watch.stop()
            self._remove_partials(journal)
            self._measure(job.out_dir)
            self.download_progress.download_stop()
        return results

    def _check_window(self, pending: list[OutputShard], sources: HubSourceFiles) -> None:
        """Refuse, before any download, a window the pending shards' layout cannot run in."""
        sizes = {f: sources.content[f].size for f in self.file_order}
        est = estimate(pending, self.file_order, sizes, 0, self.window, self.delete_source_shards)
        if pending and self.window < est.min_window:
            raise fail(
                Code.WINDOW_TOO_SMALL,
                "--max-source-window is too small for this checkpoint's layout",
                expected=f"at least {est.min_window}",
                found=str(self.window),
                hint=f"rerun with --max-source-window {est.min_window}: downloaded in "
                "the order the output needs them, that many source shards must be "
                "present at once (--dry-run shows it before any download)",
            )

    def _get_source(
        self, root: Path, file: str, expected: bool, stop: threading.Event, watch: _DownloadWatch
    ) -> None:
        """Download one source shard (a no-op if present); progress and partials reported."""
        if stop.is_set():
            raise Interrupted()
        reported = 0

        def on_bytes(n: int) -> None:
            nonlocal reported
            reported += n
            self.download_progress.download_advance(n)

        present = (root / file).exists()
        bar = DownloadBar.bound(on_open=watch.scan, on_bytes=on_bytes, stop=stop.is_set)
        self.origin.fetch(file, bar)
        assert self.origin.repo is not None
        size = self.origin.repo.files[file].size
        with self._lock:
            if not present:
                self.downloaded.append(file)
                self.downloaded_bytes += size
        if expected:
            self.download_progress.download_file_done(file, max(size - reported, 0))

    def _delete(self, root: Path, file: str) -> None:
        self.origin.delete(root, file)
        self.deleted.append(file)
        assert self.origin.repo is not None
        self.deleted_bytes += self.origin.repo.files[file].size

    def _remove_partials(self, journal: OutputDir) -> None:
        """Remove every partial download the journal records (none was another's), then
        forget them: at the start of a run (a killed run's) and at its end (this run's)."""
        for path in journal.partials():
            freed = remove_partial(path)
            if freed is not None:  # None: renamed into place when it completed
                self.partials_removed += 1
                self.partial_bytes_removed += freed
        journal.forget_partials()

    def _measure(self, out_dir: Path) -> None:
        """Disk use of downloads + output right now; called at every high-water point."""
        assert self.origin.storage is not None
        now = _tree_bytes(self.origin.storage, out_dir)
        with self._lock:
            self.peak_disk_measured = max(self.peak_disk_measured, now)

    def _check_space(
        self, out_dir: Path, pending: list[OutputShard], order: list[str], root: Path
    ) -> None:
        """The source window must fit beside the output (the output itself is checked too)."""
        repo, storage = self.origin.repo, self.origin.storage
        assert repo is not None and storage is not None
        absent = sorted(
            (repo.files[f].size for f in order if not os.path.lexists(root / f)), reverse=True
        )
        need = sum(absent[: self.window]) if self.delete_source_shards else sum(absent)
        free = shutil.disk_usage(storage).free
        if os.stat(storage).st_dev == os.stat(out_dir).st_dev:
            need += sum(s.file_size for s in pending)
        if need > free:
            raise fail(
                Code.NO_SPACE,
                "not enough free space for the downloads and the output",
                file=str(storage),
                expected=f"{need} bytes free",
                found=f"{free} bytes free",
                hint="pass --delete-source-shards and a "
                "smaller --max-source-window, or free space; --dry-run shows the peak",
            )
