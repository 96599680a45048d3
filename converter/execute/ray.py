"""`--executor ray`: each output shard is a Ray task; the driver keeps the books.

The driver plans, holds the output lock, records every finished shard in the ledger and
finalizes (checksums, config, index last) exactly as a local run does. A task runs the same
`settle` as the local executor (prove a recorded shard, or write it) on whichever node has
a free CPU, reading the source and writing the output
through a filesystem every node mounts at the same path. Since the ledger and the shard
files are the same as a local run's, a run started locally can be finished on Ray and the
other way round.

Tasks return plain data, never exceptions: our errors carry fields that do not survive
pickling through Ray, so a task reports what went wrong and the driver raises it here.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import Problem, fatal
from ..hashing import Interrupted
from ..output.records import Ledger, ShardRecord
from ..plan import OutputShard
from ..reasons import Code
from . import Executor, OnDone
from .shard import (
    Outcome,
    ShardContext,
    ShardEvents,
    ShardOutcome,
    SourceFiles,
    commit,
    settle,
)


def import_ray():
    try:
        import ray
    except ImportError:
        raise fatal(Code.USAGE, rule="ray-missing") from None
    return ray


def shard_task(
    shard: OutputShard,
    root: str,
    identity: dict[str, list[int]],
    headers: dict[str, str],
    out_dir: str,
    tmp_dir: str,
    record: ShardRecord | None,
    check_scales: bool,
    rehash: bool,
    version: str,
) -> tuple[ShardOutcome, list[Problem]]:
    """Runs on a Ray worker: settle one shard; returns its outcome and the NaN scales found.
    What it raises (`Fatal`, `SourceChanged`, `OSError`) pickles by its fields and reaches
    the driver as the cause of Ray's task error."""
    from ... import __version__

    if version != __version__:  # the plan fingerprint is only valid for one tool version
        raise fatal(Code.USAGE, rule="ray-version", driver=version, node=__version__)
    sources = SourceFiles(Path(root), shard.input_files, header_sha256=headers)
    try:
        sources.check_seen(  # the same files as the driver saw, or nothing
            {f: identity[f] for f in shard.input_files},
            "differs on this node from the driver's view (is the source on one shared "
            "filesystem at the same path?)",
        )
        nan: list[Problem] = []
        context = ShardContext(
            sources,
            Path(out_dir),
            Path(tmp_dir),
            events=ShardEvents(on_scale_nan=nan.append),
            check_scales=check_scales,
            rehash=rehash,
        )
        return settle(shard, record, context), nan
    finally:
        sources.close()


@dataclass
class RayExecutor(Executor):
    address: str | None = None  # None: RAY_ADDRESS, else a local runtime on this machine
    num_cpus: int | None = None  # only for a local runtime

    def run(
        self, shards: list[OutputShard], context: ShardContext, ledger: Ledger, on_done: OnDone
    ) -> list[ShardOutcome]:
        """Submit every shard; record results as they come. Ray places one task per free CPU
        across the cluster (`--workers` does not apply)."""
        ray = import_ray()
        from ... import __version__

        started_here = not ray.is_initialized()
        if started_here:
            address = self.address or os.environ.get("RAY_ADDRESS") or None
            ray.init(
                address=address,
                num_cpus=None if address else self.num_cpus,
                include_dashboard=False,
                log_to_driver=False,
                logging_level="warning",
            )
        # A crashed worker is retried (a rewrite of the same shard is idempotent); an error
        # our code reports is not.
        task = ray.remote(num_cpus=1, max_retries=2)(shard_task)
        # Temporaries of this driver's tasks only: a task of a killed earlier driver that Ray
        # has not reaped yet can never write into, or rename from, the files of this run.
        run_tmp = context.tmp_dir / f"ray-{uuid.uuid4().hex[:12]}"
        run_tmp.mkdir()
        # Tasks cannot reach the driver's directory state: the output stops looking complete
        # before any task may change it.
        if context.events.before_write:
            context.events.before_write()
        sources = context.sources
        pending: dict = {}
        results: list[ShardOutcome] = []
        try:
            for shard in sorted(shards, key=lambda s: -s.file_size):  # largest first
                record = ledger.done.get(shard.name)
                identity = {f: list(sources.identity[f]) for f in shard.input_files}
                headers = {
                    f: sources.header_sha256[f]
                    for f in shard.input_files
                    if f in sources.header_sha256
                }
                ref = task.remote(
                    shard,
                    str(sources.root),
                    identity,
                    headers,
                    str(context.out_dir),
                    str(run_tmp),
                    record,
                    context.check_scales,
                    context.rehash,
                    __version__,
                )
                pending[ref] = shard
            while pending:
                if context.stop.is_set():
                    raise Interrupted()
                ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
                for ref in ready:
                    shard = pending.pop(ref)
                    try:
                        result, nan = ray.get(ref)
                    except ray.exceptions.RayTaskError as exc:
                        # Ours (Fatal, SourceChanged, OSError) as the worker raised it.
                        raise exc.cause if isinstance(exc.cause, Exception) else exc from None
                    for problem in nan:
                        if context.events.on_scale_nan:
                            context.events.on_scale_nan(problem)
                    outcome = result.outcome
                    commit(result, ledger)
                    if context.events.on_bytes and outcome is Outcome.WRITTEN:
                        context.events.on_bytes(shard.file_size)
                    results.append(result)
                    on_done(result)
        except BaseException:
            context.stop.set()
            for ref in pending:
                ray.cancel(ref, force=False)
            raise
        finally:
            if started_here:
                ray.shutdown()
        return results
