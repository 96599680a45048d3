"""Execute a plan: every output shard kept (after proof) or written, then recorded.

`shard.py` holds the one core (`settle`: prove or write one shard; `commit`: record it);
the executors only schedule it:

- `local.py`: a thread pool on this machine (`--workers`);
- `hub.py`: shards as their source files arrive from the Hub, through a bounded window;
- `ray.py`: one Ray task per shard, on a cluster sharing one filesystem.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from ..fsio import Space
from ..output.records import Ledger, PartialDownloads
from ..plan import OutputShard, Plan
from ..source import Source
from .estimate import Estimate
from .shard import ShardContext, ShardOutcome, SourceFiles

OnDone = Callable[[ShardOutcome], None]


class DownloadProgress:
    """What an executor that downloads says about it while it runs; the default shows
    nothing. Called from download threads."""

    def download_start(self, total_bytes: int, files: int) -> None:
        """`total_bytes`: the source shards this run must download (not those present)."""

    def download_advance(self, nbytes: int) -> None:
        """Bytes that arrived (negative when the client rewinds a retried transfer)."""

    def download_file_done(self, file: str, unreported: int) -> None:
        """A source shard is complete; `unreported` of its bytes came without `advance`
        (found complete after all): done, but not network speed."""

    def download_stop(self) -> None: ...


class Executor(Protocol):
    """Schedules `settle` for every shard; returns the outcomes (ledger already updated).

    Everything the pipeline and the command line ask of an executor is declared here; an
    executor subclasses this and overrides only what it has something to say about (the
    defaults: sources already on disk, no downloads, nothing to add to the plan or the
    summary).
    """

    # Where source bytes arriving during the run are reported; only a downloading executor
    # calls it. The default instance shows nothing (it holds no state).
    download_progress: DownloadProgress = DownloadProgress()

    def claimed(self, downloads: PartialDownloads) -> None:
        """Called once the output directory is this run's, before its free-space check, with
        the record of partial downloads kept there (a downloading executor frees what an
        earlier run left, and records its own)."""

    def open_sources(self, source: Source) -> SourceFiles:
        """The source's shards as the run reads them (how `source` was read says where they
        come from); by default already on disk, each proven to carry the header the plan
        was made from."""
        return SourceFiles(source.root, source.shard_files, source.header_sha256)

    def plan_rows(self, plan: Plan) -> list[tuple[str, str]]:
        """Rows this executor adds to the dry run's plan table."""
        return []

    def writes_beside(self) -> Path | None:
        """The folder outside the output that a run writes in (a downloading executor: its
        downloads), whose room the output's survey reads too; None: none (the default)."""
        return None

    def preflight(
        self, out: Space | None, beside: Space | None, shards: list[OutputShard]
    ) -> Estimate | None:
        """A dry run's look ahead at what this executor adds beside the output, judged from
        the room the output's survey read (`out`: the output's filesystem; `beside`: that of
        `writes_beside`): raises as its run would refuse (a downloading one: downloads that
        cannot fit), and says how long writing `shards` will take when it knows better than
        a timed read of the source's disk (the network); None: it does not (the default)."""
        return None

    def summary(self, plan: Plan) -> dict:
        """Keys this executor adds to the run's summary (and its `--json`)."""
        return {}

    def run(
        self, shards: list[OutputShard], context: ShardContext, ledger: Ledger, on_done: OnDone
    ) -> list[ShardOutcome]: ...
