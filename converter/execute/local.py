"""The local executor: shards on a thread pool.

Threads, not processes: every hot call (copy_file_range, pread, write, fsync, crc32) releases
the GIL, and a thread pool shares the stop flag and the open source files for free.
"""

from __future__ import annotations

import os
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass

from ..hashing import Interrupted
from ..output.records import Ledger, PartialDownloads
from ..plan import OutputShard
from . import Executor, OnDone
from .shard import ShardContext, ShardOutcome, commit, settle


def default_workers() -> int:
    # Each shard stream keeps about two cores busy (the kernel copy and its checksum thread);
    # more streams than that only contend. Beyond 8 a single filesystem rarely gains.
    return max(1, min((os.cpu_count() or 1) // 2, 8))


@dataclass
class LocalExecutor(Executor):
    workers: int = 0  # 0: default_workers()

    def claimed(self, downloads: PartialDownloads) -> None:
        """Nothing to prepare."""

    def run(
        self, shards: list[OutputShard], context: ShardContext, ledger: Ledger, on_done: OnDone
    ) -> list[ShardOutcome]:
        def task(shard: OutputShard) -> ShardOutcome:
            result = settle(shard, ledger.done.get(shard.name), context)
            commit(result, ledger)
            on_done(result)
            return result

        # Largest first keeps the tail short when shards differ in size.
        order = sorted(shards, key=lambda s: -s.file_size)
        workers = self.workers or default_workers()
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard") as pool:
            futures = [pool.submit(task, s) for s in order]
            try:
                done, _ = wait(futures, return_when=FIRST_EXCEPTION)
                if any(f.exception() is not None for f in done):
                    context.stop.set()
                    wait(futures)
                    raise_first([f.exception() for f in futures])
            except KeyboardInterrupt:
                context.stop.set()
                wait(futures)
                raise
        return [f.result() for f in futures]


def raise_first(errors: list[BaseException | None]) -> None:
    """Raise the first real error of a batch (a worker's Interrupted only echoes another's)."""
    errors = [e for e in errors if e is not None]
    real = [e for e in errors if not isinstance(e, Interrupted)]
    if real or errors:
        raise (real or errors)[0]
