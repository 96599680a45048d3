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
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import EXIT_USAGE, Code, fail
from ..hashing import Interrupted
from ..outdir import Ledger
from ..plan import OutputShard
from ..source.hub import HubOrigin, HubRepo
from . import OnDone
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


def estimate(shards: list[OutputShard], file_order: list[str], sizes: dict[str, int],
             small_bytes: int, window: int, delete: bool) -> DiskEstimate:
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
    return DiskEstimate(min_window, window, output_bytes + small_bytes + source_part,
                        output_bytes, sum(sizes[f] for f in file_order), small_bytes)


class HubSourceFiles(SourceFiles):
    """Source shards that arrive (and may leave) during the run.

    `identity` is recorded when a shard lands, so a file changed under us is still caught;
    `fingerprint` (what records keep) names content instead.
    """

    def __init__(self, root: Path, repo: HubRepo, files: list[str],
                 header_sha256: dict[str, str]) -> None:
        # No file is there yet: identities are taken as shards arrive. A downloaded shard
        # must still carry the very header the plan was made from.
        super().__init__(root, [], header_sha256=header_sha256)
        self.content = {f: repo.files[f] for f in files}

    def arrived(self, file: str) -> None:
        with self._lock:
            self.identity[file] = file_identity(self.root / file)

    def release(self, file: str) -> None:
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


@dataclass
class HubExecutor:
    origin: HubOrigin
    window: int = DEFAULT_WINDOW
    delete_source_shards: bool = False
    workers: int = 1
    file_order: list[str] = field(default_factory=list)  # source shards in index order
    peak_disk_measured: int = 0
    downloaded: list[str] = field(default_factory=list)
    deleted: list[str] = field(default_factory=list)
    _meter_lock: threading.Lock = field(default_factory=threading.Lock)

    def source_files(self, root: Path, shard_files: list[str],
                     header_sha256: dict[str, str]) -> HubSourceFiles:
        assert self.origin.repo is not None
        self.file_order = list(shard_files)
        return HubSourceFiles(root, self.origin.repo, shard_files, header_sha256)

    def estimate(self, shards: list[OutputShard]) -> DiskEstimate:
        repo = self.origin.repo
        assert repo is not None
        sizes = {f: repo.files[f].size for f in self.file_order}
        small = sum(repo.files[f].size for f in self.origin.small_files)
        return estimate(shards, self.file_order, sizes, small, self.window,
                        self.delete_source_shards)

    def run(self, shards: list[OutputShard], job: Job, ledger: Ledger,
            on_done: OnDone) -> list[ShardOutcome]:
        sources = job.sources
        assert isinstance(sources, HubSourceFiles)
        root = sources.root
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
        est = estimate(pending, self.file_order, {f: sources.content[f].size
                                                  for f in self.file_order}, 0, self.window,
                       self.delete_source_shards)
        if pending and self.window < est.min_window:
            raise fail(Code.WINDOW_TOO_SMALL, "--max-source-window is too small for this "
                       "checkpoint's layout", expected=f"at least {est.min_window}",
                       found=str(self.window), exit_code=EXIT_USAGE,
                       hint=f"rerun with --max-source-window {est.min_window}")
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

        arrived: set[str] = set()
        submitted: set[str] = set()
        queue = list(order)
        live: set[str] = set()
        downloads: dict[Future, str] = {}
        writes: dict[Future, OutputShard] = {}
        pool = ThreadPoolExecutor(max_workers=max(1, self.workers), thread_name_prefix="shard")

        def start_downloads() -> None:
            while (queue and len(live) < self.window and len(downloads) < _MAX_DOWNLOADS
                   and not job.stop.is_set()):
                f = queue.pop(0)
                live.add(f)
                downloads[_in_daemon_thread(self._get_source, f, job.stop)] = f

        def on_arrival(f: str) -> None:
            sources.arrived(f)
            arrived.add(f)
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
                        sources.release(f)
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
            # Writes stop at their next chunk; a download cannot be interrupted, so it is left
            # to finish or die with the process (huggingface_hub renames only whole files).
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
            self._measure(job.out_dir)
        return results

    def _get_source(self, file: str, stop: threading.Event) -> None:
        if stop.is_set():
            raise Interrupted()
        self.origin.fetch(file)
        self.downloaded.append(file)

    def _delete(self, root: Path, file: str) -> None:
        self.origin.delete(root, file)
        self.deleted.append(file)

    def _measure(self, out_dir: Path) -> None:
        """Disk use of downloads + output right now; called at every high-water point."""
        assert self.origin.storage is not None
        now = _tree_bytes(self.origin.storage, out_dir)
        with self._meter_lock:
            self.peak_disk_measured = max(self.peak_disk_measured, now)

    def _check_space(self, out_dir: Path, pending: list[OutputShard], order: list[str],
                     root: Path) -> None:
        """The source window must fit beside the output (the output itself is checked too)."""
        repo, storage = self.origin.repo, self.origin.storage
        assert repo is not None and storage is not None
        absent = sorted((repo.files[f].size for f in order if not os.path.lexists(root / f)),
                        reverse=True)
        need = sum(absent[: self.window]) if self.delete_source_shards else sum(absent)
        free = shutil.disk_usage(storage).free
        if os.stat(storage).st_dev == os.stat(out_dir).st_dev:
            need += sum(s.file_size for s in pending)
        if need > free:
            raise fail(Code.NO_SPACE, "not enough free space for the downloads and the output",
                       file=str(storage), expected=f"{need} bytes free",
                       found=f"{free} bytes free", hint="pass --delete-source-shards and a "
                       "smaller --max-source-window, or free space; --dry-run shows the peak")
