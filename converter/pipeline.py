"""`kimi-convert SRC OUT`: resolve -> read headers -> validate -> plan -> execute -> finalize.

One pass down. Everything up to the plan reads headers only and writes nothing, so every
problem with the source is reported before the first byte of output exists. The output
directory (`output/`) is claimed, every shard is kept after proof or written
(`execute/`), then the other files, the checksums and the config are made what they must
be and the index is written last: a directory with an index is a complete conversion.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .. import __version__
from . import faults
from .errors import Fatal, Problem, fatal
from .execute import Executor
from .execute.estimate import Estimate, estimate
from .execute.local import LocalExecutor
from .execute.shard import (
    Outcome,
    ShardContext,
    ShardEvents,
    ShardOutcome,
    SourceChanged,
    SourceFiles,
    why_not_kept,
)
from .manifest import DEFAULT_MANIFEST, Manifest, load_manifest
from .output.directory import OutputDir, Standing
from .output.final import final_files
from .output.records import FinalFiles, Mode, ShardRecord, space_refusal
from .output.session import Session
from .plan import DEFAULT_MAX_SHARD_SIZE, Plan, plan_conversion
from .reasons import Code
from .source import Origin, Source, read_source, source_id
from .source.local import LocalOrigin
from .validate import validate_source


@dataclass
class ConvertOptions:
    source: str
    out: Path
    manifest: str = DEFAULT_MANIFEST
    revision: str | None = None
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    dry_run: bool = False
    force: bool = False
    check_scales: bool = False
    rehash: bool = False  # prove kept shards by re-reading their data too
    origin: Origin = field(default_factory=LocalOrigin)
    executor: Executor = field(default_factory=LocalExecutor)

    def __post_init__(self) -> None:
        # Options that no run can use are refused where they are made, before anything.
        if self.max_shard_size <= 0:
            raise fatal(Code.USAGE, rule="max-shard-size", size=self.max_shard_size)


@dataclass
class Preview:
    """What a run would do with an earlier run's shards (`--dry-run`)."""

    mode: Mode
    keep: list[str] = field(default_factory=list)
    redo: dict[str, str] = field(default_factory=dict)  # shard -> why it is not kept


@dataclass
class ConvertResult:
    plan: Plan
    source: Source
    out: Path
    mode: Mode | None = None
    seconds: float = 0.0
    outcomes: list[ShardOutcome] = field(default_factory=list)
    files_rewritten: int = 0
    warnings: list[str] = field(default_factory=list)
    preview: Preview | None = None
    rehash: bool = False  # kept shards' data re-read this run
    space: tuple[int, int] | None = None  # dry run: (bytes to write, bytes free)
    estimate: Estimate | None = None  # dry run: how long the writing will take

    def count(self, outcome: Outcome) -> int:
        return sum(1 for o in self.outcomes if o.outcome is outcome)

    @property
    def bytes_written(self) -> int:
        return sum(o.bytes_written for o in self.outcomes)

    @property
    def bytes_kept(self) -> int:
        kept = {o.shard for o in self.outcomes if o.outcome is Outcome.KEPT}
        return sum(s.file_size for s in self.plan.shards if s.name in kept)

    @property
    def already_complete(self) -> bool:
        """A rerun on a finished output that proved it and changed nothing."""
        return (
            self.mode is Mode.RECHECK
            and not self.count(Outcome.WRITTEN)
            and not self.files_rewritten
        )

    def summary(self) -> dict:
        p = self.plan
        out = {
            "source": str(self.source.root),
            "output": str(self.out),
            "dry_run": self.preview is not None,
            "mode": self.mode.value if self.mode else None,
            "already_complete": self.already_complete,
            "output_shards": len(p.shards),
            "tensors": p.tensors,
            "experts_fused": p.experts_fused,
            "moe_layers": len(p.layers),
            "output_bytes": p.output_bytes,
        }
        if self.preview is not None:
            out["would_keep"] = self.preview.keep
            out["would_write"] = sorted(self.preview.redo)
            out["redo_reasons"] = self.preview.redo
            if self.space is not None:
                out["space_needed_bytes"], out["free_bytes"] = self.space
                out["space_ok"] = self.space[0] <= self.space[1]
            if self.estimate is not None:
                out |= self.estimate.as_json()
            return out
        out |= {
            "shards_written": self.count(Outcome.WRITTEN),
            "shards_kept": self.count(Outcome.KEPT),
            "bytes_written": self.bytes_written,
            "bytes_kept": self.bytes_kept,
            "redone": {o.shard: o.redo_reason for o in self.outcomes if o.redo_reason},
            # What keeping a shard proved: never more than was read (`kept_data_reread`).
            "kept_proven_by": KEPT_PROOF_REHASH if self.rehash else KEPT_PROOF,
            "kept_data_reread": self.rehash or not self.count(Outcome.KEPT),
            "files_rewritten": self.files_rewritten,
            "seconds": round(self.seconds, 3),
            # Only what this run moved: bytes kept from an earlier run cost no time here.
            "throughput_mb_s": round(self.bytes_written / self.seconds / 1e6, 1)
            if self.seconds and self.bytes_written
            else None,
            "warnings": self.warnings,
        }
        return out


KEPT_PROOF = "size, header bytes and source identity (data not re-read: --rehash re-reads it)"
KEPT_PROOF_REHASH = "size, header bytes, source identity and every tensor's checksum"


class Reporter:
    """What the CLI shows while a conversion runs; the default shows nothing."""

    def start(self, total_bytes: int, shards: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...
    def shard_done(self, result: ShardOutcome) -> None: ...
    def warn(self, message: str) -> None: ...
    def stop(self) -> None: ...


def prepare(opts: ConvertOptions) -> tuple[Source, Manifest, Plan]:
    """Resolve, read headers, validate, plan: no writes. Raises with every problem."""
    manifest = load_manifest(opts.manifest)
    found = opts.origin.resolve(opts.source, opts.revision)
    root = found.root
    out = Path(os.path.realpath(opts.out.expanduser()))  # a link loop: no exception
    if out == root or root in out.parents:
        raise fatal(Code.OUTPUT_INSIDE_SOURCE, file=out, source=root)
    with gc_paused():
        source = read_source(root, opts.source, found.reader)
        table, problems = validate_source(source, manifest)
        if problems:
            hint = None
            if manifest.pinned:
                hint = (
                    f"the checkpoint does not match manifest '{manifest.name}'; for "
                    "scaled-down or modified checkpoints pass --manifest kimi-k3-any"
                )
            raise Fatal(problems, hint=hint)
        plan = plan_conversion(source, table, opts.max_shard_size, __version__, manifest.sha256)
    return source, manifest, plan


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic GC off for a while, as it was afterwards. A plan of the real model is ~2M
    small objects, none in a cycle: with the GC on, every collection rescans them all (it
    costs ~40% of planning). Afterwards they would all be young, and the next collection
    would scan them once more: frozen then unfrozen, they join the oldest generation without
    a scan (unless the process froze objects itself: unfreezing would thaw its own)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            if gc.get_freeze_count() == 0:
                gc.freeze()
                gc.unfreeze()
            gc.enable()


def convert(opts: ConvertOptions, reporter: Reporter | None = None) -> ConvertResult:
    with gc_paused():  # the plan lives until the end: see `gc_paused`
        return _convert(opts, reporter or Reporter())


def _convert(opts: ConvertOptions, reporter: Reporter) -> ConvertResult:
    source, manifest, plan = prepare(opts)
    identity = source_id(source, source.reader)
    sources = opts.executor.open_sources(source)
    try:
        # Computed before the output is looked at: a source problem found here changes nothing.
        final = None if opts.dry_run else final_files(source, plan, manifest, identity.name)
        out = OutputDir(opts.out, beside=opts.executor.writes_beside())
        # Refused before anything, in a dry run as in a run (whose claim judges again).
        decision = out.resume_decision(plan.fingerprint, identity, opts.force)
        result = ConvertResult(plan, source, out.root, rehash=opts.rehash)
        if final is not None:
            sizes = {s.name: s.file_size for s in plan.shards}
            # Judged again under the lock; from here the lock is released however the
            # block is left (`Session`).
            run = out.claim(plan.fingerprint, opts.force, identity, sizes, opts.executor.claimed)
            with run:
                _run(opts, run, plan, sources, final, reporter, result)
        else:  # a dry run: what a run would keep, proven as a run proves it (read-only)
            context = ShardContext(sources, out.root, out.tmp, rehash=opts.rehash)
            result.preview = preview(decision.mode, decision.records, plan, context)
            _tell_before_starting(result, source, opts.executor, decision.standing)
    finally:
        sources.close()
    return result


def _tell_before_starting(
    result: ConvertResult, source: Source, executor: Executor, standing: Standing
) -> None:
    """What a dry run owes before a long job: whether the output fits (refused with the
    reason a run's claim gives, by the same rule) and how long the job will take. The room
    is judged from what the output's survey read (`standing`), as every other refusal."""
    assert result.preview is not None
    sizes = {s.name: s.file_size for s in result.plan.shards}
    needed = sum(sizes[name] for name in result.preview.redo)
    # None only where the output path has no folder to write in: refused before this.
    free = standing.space.free if standing.space is not None else 0
    result.space = (needed, free)
    refusal = space_refusal(result.out, needed, free)
    if refusal is not None:
        raise refusal
    pending = [s for s in result.plan.shards if s.name in result.preview.redo]
    # What it adds beside the output (downloads): refused, or how long they take.
    result.estimate = executor.preflight(standing.space, standing.beside, pending) or estimate(
        needed, source.root, source.shard_files
    )


def preview(
    mode: Mode, records: Mapping[str, ShardRecord], plan: Plan, context: ShardContext
) -> Preview:
    """Which shards a run in `mode` would keep and which it would write, proven as a run
    proves them (read-only: no lock, nothing written)."""
    result = Preview(mode)
    for shard in plan.shards:
        reason = why_not_kept(shard, records.get(shard.name), context)
        if reason is None:
            result.keep.append(shard.name)
        else:
            result.redo[shard.name] = reason
    return result


def _run(
    opts: ConvertOptions,
    run: Session,
    plan: Plan,
    sources: SourceFiles,
    final: FinalFiles,
    reporter: Reporter,
    result: ConvertResult,
) -> None:
    result.mode = run.mode
    for warning in run.output.warnings:
        result.warnings.append(warning)
        reporter.warn(warning)
    scale_problems: list[Problem] = []
    lock = threading.Lock()

    def on_done(outcome: ShardOutcome) -> None:
        with lock:
            result.outcomes.append(outcome)
        reporter.shard_done(outcome)

    events = ShardEvents(
        on_bytes=reporter.advance,
        on_scale_nan=scale_problems.append,
        before_write=run.output.begin_writes,
    )
    context = ShardContext(
        sources,
        run.output.root,
        run.output.tmp,
        events=events,
        check_scales=opts.check_scales,
        rehash=opts.rehash,
    )
    reporter.start(plan.output_bytes, len(plan.shards))
    started = time.perf_counter()
    try:
        try:
            opts.executor.run(plan.shards, context, run.ledger, on_done)
        finally:
            reporter.stop()
        if scale_problems:
            raise Fatal(
                scale_problems,
                hint="the source has NaN scales; nothing was finalized (no index written)",
            )
        faults.fault_point("shards.settled")
        # Published only if every source file the output derives from (shards written or
        # kept, config, index, files copied) is still the file read: a proof made against
        # what was seen at the start says nothing of a file replaced since.
        result.files_rewritten = run.finalize(
            final, lambda: sources.prove_unchanged(final.derived_from)
        )
    except SourceChanged as exc:  # worded while the state it describes still holds
        raise fatal(
            Code.SOURCE_CHANGED,
            rule="read",
            file=exc.file,
            change=exc.detail,
            hint=run.output.resume_hint("make sure nothing writes to the source"),
        ) from None
    result.seconds = time.perf_counter() - started
