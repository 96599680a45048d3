"""The download executor (`--download`): shards written as their source files arrive.

It asks of the origin only what `Remote` declares (sizes, content ids, fetch, delete, where
downloads go and how its partial downloads are named): the Hub is one such origin
(`source/hub.py`); another is one more file that implements `Remote` beside `Origin`.

The run itself, the window of source shards and the downloads in flight, is a `Stream`
(`stream.py`); this executor declares what the pipeline and the command line ask of it,
refuses before any download a window the plan cannot stream through or that cannot fit,
and hands the rest to the stream. Peak disk is the output plus the window of source shards.

Resume: records of a Hub run name source shards by content (size and the Hub's ETag, the
sha256 of an LFS file), not by inode, so an output shard whose source shards were deleted is
still proven and nothing it needed is downloaded again.

Partial downloads: a download cut short by Ctrl-C or a kill leaves the client's temporary
file behind (huggingface_hub's, for the Hub), which no later download reuses. Each one this
run starts is recorded in the output's state folder as it appears (`stream.py`), and
every recorded one is removed when the run ends, however it ends, and at the start of the
next run (after a kill).
Files nobody recorded, another process's among them, are never touched.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .. import fsio
from ..errors import fatal
from ..fsio import Space
from ..output.records import Ledger, PartialDownloads
from ..plan import OutputShard, Plan
from ..reasons import Code
from ..source import Source
from ..text import Size, human_size
from . import DownloadProgress, Executor, OnDone
from .estimate import Estimate
from .remote import Remote, StreamedSources
from .shard import Outcome, ShardContext, ShardOutcome, why_not_kept
from .stream import DiskEstimate, Stream, Tally, Window, estimate, fewest_slots

DEFAULT_WINDOW = 4


@dataclass
class DownloadExecutor(Executor):
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

    def open_sources(self, source: Source) -> StreamedSources:
        reader = source.reader
        if not isinstance(reader, Remote):  # a wiring error: no user input leads here
            raise TypeError("streaming needs a source read from a remote origin")
        self._sources = StreamedSources(
            source.root, reader, source.shard_files, source.header_sha256
        )
        return self._sources

    # -- what the CLI shows: the dry run's rows, the --json block --------------------------
    def plan_rows(self, plan: Plan) -> list[tuple[str, str]]:
        from ..text import human

        sources = self._sources
        if sources is None:  # told no source: nothing to say (the protocol's default)
            return []
        est = self._estimate(plan, sources)
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

    def writes_beside(self) -> Path | None:
        return self._sources.remote.storage if self._sources is not None else None

    def preflight(
        self, out: Space | None, beside: Space | None, shards: list[OutputShard]
    ) -> Estimate | None:
        """A dry run's look ahead, in one step: the downloads still to come refused as the
        run refuses them where they cannot fit (judged from the room the output's survey
        read), then their time at a measured network rate."""
        sources = self._sources
        if sources is None or not shards:
            return None
        absent = self._to_download(shards, sources)
        if out is not None and beside is not None:
            self._check_space(out, beside, shards, absent, sources)
        return self._measure(absent, sources)

    def _measure(self, absent: list[str], sources: StreamedSources) -> Estimate | None:
        """The downloads' time at a measured network rate: a short timed download of the
        largest source shard still to come (nothing to download: the disk estimate)."""
        # Optional to a Remote (`measure`): one that cannot time a fetch gets no estimate.
        measure = getattr(sources.remote, "measure", None)
        if measure is None or not absent:
            return None
        total = sum(sources.remote.size(f) for f in absent)
        largest = max(absent, key=sources.remote.size)
        nbytes, seconds = measure(largest)
        if nbytes <= 0 or seconds <= 0:
            return Estimate(None, None, f"not measured: downloading {largest} gave nothing")
        rate = nbytes / seconds
        return Estimate(
            total / rate,
            rate,
            f"download measured at {human_size(rate)}/s over {human_size(nbytes)} of {largest} "
            f"for the {human_size(total)} of source shards to download; the conversion runs "
            "beside the downloads",
        )

    def summary(self, plan: Plan) -> dict:
        sources, t = self._sources, self.tally
        if sources is None:  # told no source: nothing to say (the protocol's default)
            return {}
        est = self._estimate(plan, sources)
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
                "deleted_shared_kept": t.shared_kept,
                "partial_downloads_removed": t.partials_removed,
                "partial_bytes_removed": t.partial_bytes_removed,
            }
        }

    def _estimate(self, plan: Plan, sources: StreamedSources) -> DiskEstimate:
        """The window replayed over the plan: its feasibility and the peak-disk bound."""
        sizes = {f: sources.remote.size(f) for f in sources.order}
        return estimate(
            plan.shards,
            sources.order,
            sizes,
            sources.remote.other_bytes(),
            self.window,
            self.delete_source_shards,
        )

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
        # Either may not exist yet: the folder it will be made in stands in.
        here, there = fsio.space(context.out_dir), fsio.space(sources.remote.storage)
        self._check_space(here, there, pending, self._to_download(pending, sources), sources)
        # 3. Stream.
        stream = Stream(self, pending, window, sources, context, ledger, journal, reasons, on_done)
        results += stream.run()
        return results

    def _check_window(self, pending: list[OutputShard], sources: StreamedSources) -> None:
        """Refuse, before any download, a window the pending shards' layout cannot run in."""
        need = fewest_slots(pending, sources.order)
        if pending and self.window < need:
            raise fatal(Code.WINDOW_TOO_SMALL, need=need, window=self.window)

    @staticmethod
    def _to_download(shards: list[OutputShard], sources: StreamedSources) -> list[str]:
        """The source shards `shards` need that are not on disk yet, in index order."""
        needed = {f for s in shards for f in s.input_files}
        return [f for f in sources.order if f in needed and not os.path.lexists(sources.root / f)]

    def _check_space(
        self,
        out: Space,
        there: Space,
        pending: list[OutputShard],
        absent: list[str],
        sources: StreamedSources,
    ) -> None:
        """The source window must fit in the room `there` is (the downloads' filesystem),
        with the output's shards too where both are on one filesystem (`out`)."""
        sizes = sorted((sources.remote.size(f) for f in absent), reverse=True)
        need = sum(sizes[: self.window]) if self.delete_source_shards else sum(sizes)
        if there.device == out.device:
            need += sum(s.file_size for s in pending)
        if need > there.free:
            storage, free = sources.remote.storage, there.free
            raise fatal(
                Code.NO_SPACE, rule="downloads", file=storage, need=Size(need), free=Size(free)
            )
