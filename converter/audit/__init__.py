"""The audit behind `kimi-convert verify OUT`: prove a converted checkpoint complete, intact
and correct.

Levels; each includes the structure level, `--source` includes `--checksums` where the output
has a checksums file, `--numerics` needs `--source`:

  structure  (always)       index, headers, config block, the routed experts derived from
                            the contract, every file recorded; no tensor data read
  checksums  (--checksums)  every byte against the checksums the conversion recorded
  source     (--source)     every tensor and file against the source, byte for byte
  numerics   (--numerics)   sampled experts computed with source and converted semantics

A verify that reads every byte (`--checksums`, `--source`) and passes records its levels and
the identity of every file of the checkpoint in the output's state folder; a failing one
removes that record (`verified.settle`): a server refuses a checkpoint that was not verified
where it stands, or that changed since (`verified.served_refusal`).

Verification stands apart from the converter: it imports the contract, the safetensors and
source readers, the manifest, hashing and the numpy reference, never the planner, the
validation table, the pipeline or the executors, so it cannot share their mistakes.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import fatal
from ..manifest import Manifest, load_manifest
from ..output import verified
from ..reasons import Code
from .against_source import check_against_source, locate_source
from .checksums import check_checksums
from .meter import MeterFactory, silent
from .report import Check, VerifyReport
from .structure import check_structure

__all__ = ["Check", "VerifyReport", "verify"]


def verify(
    root: Path,
    manifest: str | None = None,
    checksums: bool = False,
    source: str | None = None,
    numerics: bool = False,
    sample: int | None = 8,
    seed: int = 0,
    workers: int = 2,
    meter: MeterFactory = silent,
) -> VerifyReport:
    """Run the levels asked for; every finding is in the report, never raised.

    Raises `Fatal` only for a request that cannot be run, before reading anything:
    --numerics without --source, a sample or worker count below 1, a --manifest that cannot
    be loaded, a --source that is missing, is the output, or is no source (exit 2 for usage,
    1 for the source's own problems).
    """
    if numerics and not source:
        raise fatal(Code.USAGE, rule="numerics-source")
    if sample is not None and sample < 1:
        raise fatal(Code.USAGE, rule="sample", sample=sample)
    if workers < 1:
        raise fatal(Code.USAGE, rule="workers", workers=workers)
    explicit = load_manifest(manifest) if manifest else None
    root = Path(root).expanduser().absolute()
    if source:  # every argument judged before any data is read
        locate_source(source, root)
    report = VerifyReport(str(root), levels=_levels(checksums, source, numerics))
    before = _identities(root) if verified.REQUIRED_LEVEL in report.levels else None
    _run_levels(root, explicit, report, checksums, source, numerics, sample, seed, workers, meter)
    report.record = verified.settle(root, report.levels, report.ok, before)
    return report


def _identities(root: Path) -> verified.Identities | None:
    """The checkpoint's files as they stand before anything is read (None: not listable)."""
    try:
        return verified.identities(root)
    except OSError:
        return None


def _run_levels(
    root: Path,
    explicit: Manifest | None,
    report: VerifyReport,
    checksums: bool,
    source: str | None,
    numerics: bool,
    sample: int | None,
    seed: int,
    workers: int,
    meter: MeterFactory,
) -> None:
    out = check_structure(root, explicit, report)
    if out is None:
        return
    if checksums or source:
        if checksums or out.files_recorded:
            check_checksums(out, workers, meter, report)
        else:
            report.skip(
                "checksums",
                "checksums",
                "checksums",
                "skipped: no checksums file (--source proves the data without it)",
            )
    if source:
        src = check_against_source(out, source, workers, meter, report)
        if numerics and src is not None:
            from .numerics import check_numerics  # numpy and the reference: only here

            check_numerics(out, src, sample, seed, meter, report)


def _levels(checksums: bool, source: str | None, numerics: bool) -> list[str]:
    levels = ["structure"]
    if checksums or source:
        levels.append("checksums")
    if source:
        levels.append("source")
    if numerics:
        levels.append("numerics")
    return levels
