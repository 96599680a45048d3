"""Execute a plan: every output shard kept (after proof) or written, then recorded.

`shard.py` holds the one core (`settle`: prove or write one shard; `commit`: record it);
the executors only schedule it:

- `local.py`: a thread pool on this machine (`--workers`);
- `hub.py`: shards as their source files arrive from the Hub, through a bounded window;
- `ray.py`: one Ray task per shard, on a cluster sharing one filesystem.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from ..outdir import Ledger, OutputDir
from ..plan import OutputShard
from .shard import Job, ShardOutcome

OnDone = Callable[[ShardOutcome], None]


class Executor(Protocol):
    """Schedules `settle` for every shard; returns the outcomes (ledger already updated)."""

    def claimed(self, out: OutputDir) -> None:
        """Called once the output directory is this run's, before its free-space check."""

    def run(
        self, shards: list[OutputShard], job: Job, ledger: Ledger, on_done: OnDone
    ) -> list[ShardOutcome]: ...
