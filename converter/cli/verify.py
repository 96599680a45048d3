"""The `verify` command: click parses, `verify()` proves, this module renders.

One line per check (ok / FAIL / skip with what it covered), then every problem with its
code (a problem that follows from another one listed is counted, not repeated); `--json`
prints the report with each problem's `code` and the exit code. Exit codes come from each
reason's record (`errors.reason(code).exit`), as in every command: 0 every check passed, 1 a
check failed, 2 usage error, 130 interrupted, 143 terminated.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape

from ..audit import verify as run_verify
from ..audit.report import VerifyReport
from ..errors import fatal
from ..reasons import Code
from ..text import plural
from . import console
from .arguments import (
    PathArg,
    json_option,
    manifest_option,
    progress_option,
    quiet_option,
    seed_option,
    workers_option,
)
from .console import err, out, run_guarded

INTERRUPTED = "verification stopped; nothing was changed"
SHOWN_PER_CHECK = 20  # problems printed per failed check (--json has up to 1000)
DEFAULT_SAMPLE = 8


@click.command("verify")
@click.argument("output", metavar="OUT_DIR", type=PathArg(path_type=Path))
@click.option(
    "--checksums",
    is_flag=True,
    help="Re-read every byte and compare it with the checksums the conversion "
    "recorded (CRC-32 per tensor, sha256 per file); also finds 0xFF (NaN) scales. Catches "
    "accidents (bad disks, torn copies), not deliberate edits.",
)
@click.option(
    "--source",
    type=PathArg(path_type=str),
    metavar="SRC_DIR_OR_REPO_ID",
    default=None,
    help="Compare the output with its source byte for byte: w31 = w3 bytes then "
    "w1 bytes, everything else identical, config and other files too. A directory, or a repo id "
    "in the local Hugging Face cache. Includes --checksums when the output has a checksums file.",
)
@click.option(
    "--numerics",
    is_flag=True,
    help="With --source: compute sampled experts from the source (w1 gate, w3 up) "
    "and from the output (w31 split by the block's fc1_order) with the SiTU MLP in fp32; they "
    "must agree. One expert in memory at a time.",
)
@click.option(
    "--experts",
    "sample",
    type=click.IntRange(1),
    default=None,
    metavar="N",
    help=f"With --numerics: how many experts to sample [default: {DEFAULT_SAMPLE}].",
)
@click.option(
    "--all",
    "all_experts",
    is_flag=True,
    help="With --numerics: every expert of every MoE layer instead of a sample.",
)
@seed_option("--numerics' expert sample and random inputs", default=None)
@manifest_option(None, "the one recorded in the output's kimi_w31 block, else kimi-k3-any")
@workers_option(
    "verify", "Files --checksums and --source read", " (each holds at most two 8 MiB buffers)"
)
@progress_option
@json_option("the report (every check, every problem with its code)")
@quiet_option("report")
def verify(
    output: Path,
    checksums: bool,
    source: str | None,
    numerics: bool,
    sample: int | None,
    all_experts: bool,
    seed: int | None,
    manifest: str | None,
    workers: int,
    progress_mode: str,
    as_json: bool,
    quiet: bool,
) -> None:
    """Prove that OUT_DIR is a complete, intact and correct conversion.

    Always (seconds, headers only): the index against the shards, every shard header, the
    config's kimi_w31 block, every routed expert of every MoE layer (derived from the
    config, not from the converter), and every file recorded by the conversion.
    --checksums, --source and --numerics read data (see each option); progress shows the
    total and an ETA. A passing verify that read every byte records, in OUT_DIR's state
    folder, what it proved and the identity of each file; the server refuses a checkpoint
    without that record where it stands, or changed since.

    \b
    Examples:
      kimi-convert verify out/                          structure only (seconds)
      kimi-convert verify out/ --checksums              every byte vs the recorded checksums
      kimi-convert verify out/ --source /data/Kimi-K3   byte for byte against the source
      kimi-convert verify out/ --source SRC --numerics --experts 16 --seed 3
      kimi-convert verify out/ --checksums --json > report.json
      nohup kimi-convert verify out/ --source SRC --progress lines > verify.log 2>&1 &

    Exit codes: 0 every check passed, 1 a check failed (each problem has a code; see
    --json), 2 usage error, 130 interrupted, 143 terminated. Verify writes nothing but
    that record (a failing verify removes it).
    """

    def body() -> None:
        _check_usage(numerics, sample, all_experts, seed)
        mode = console.resolve_mode(progress_mode, quiet, as_json)
        report = run_verify(
            output,
            manifest=manifest,
            checksums=checksums,
            source=source,
            numerics=numerics,
            sample=None if all_experts else (sample or DEFAULT_SAMPLE),
            seed=seed or 0,
            workers=workers,
            meter=lambda label, total, unit: console.Progress(mode, label, total, unit=unit),
        )
        if as_json:
            out.print_json(json.dumps(report.as_dict()))
        elif quiet:
            _print_problems(report, err)
        else:
            _print_report(report)
        if not report.ok:
            if not as_json:
                failed = [c for c in report.checks if c.ok is False]
                total = sum(c.problems_total for c in failed) - report.suppressed
                more = (
                    f" ({report.suppressed} more follow from them, not listed)"
                    if report.suppressed
                    else ""
                )
                err.print(
                    f"[bold red]error:[/] verification failed: {plural(total, 'problem')} in "
                    f"{plural(len(failed), 'check')}{more}"
                )
                if report.repair:
                    err.print(
                        "[yellow]repair:[/] rerun the conversion with --rehash (it re-reads "
                        "every shard and rewrites what differs; SRC is the source it was "
                        f"converted from): {escape(report.repair)}"
                    )
            sys.exit(report.exit_code)

    run_guarded(body, as_json, interrupted=INTERRUPTED)


def _check_usage(numerics: bool, sample: int | None, all_experts: bool, seed: int | None) -> None:
    if not numerics:
        given = [
            n
            for n, v in (
                ("--experts", sample),
                ("--all", all_experts),
                ("--seed", seed is not None),
            )
            if v
        ]
        if given:
            raise fatal(Code.USAGE, rule="numerics-options", options=", ".join(given))
    if sample is not None and all_experts:
        raise fatal(Code.USAGE, rule="experts-with-all")


_MARKS = {True: "[green]ok[/]  ", False: "[bold red]FAIL[/]", None: "[dim]skip[/]"}


def _print_report(report: VerifyReport) -> None:
    out.print(f"verify {escape(report.output)} ({', '.join(report.levels)})")
    hidden = report.hidden
    for check in report.checks:
        detail = f": {escape(check.detail)}" if check.detail else ""
        count = ""
        if check.ok is False:
            suppressed = check.suppressed(hidden)
            count = f" ({plural(check.problems_total - suppressed, 'problem')}"
            if suppressed:
                count += f"; {suppressed} more that follow from a cause listed below"
            count += ")"
        out.print(f"  {_MARKS[check.ok]}  {escape(check.title)}{detail}{count}")
    _print_problems(report, out)
    if report.ok:
        skipped = sum(c.ok is None for c in report.checks)
        note = f" ({plural(skipped, 'check')} skipped)" if skipped else ""
        out.print("[green]passed[/]" + note)
    if report.record:
        out.print(f"verification record for serving: {escape(report.record)}")


def _print_problems(report: VerifyReport, where: Console) -> None:
    hidden = report.hidden
    for check in report.checks:
        roots = check.roots(hidden)
        if check.ok is not False or not roots:
            continue
        where.print(f"{escape(check.title)}:")
        for p in roots[:SHOWN_PER_CHECK]:
            where.print(f"  - [{p.code.value}] {p.render()}", markup=False)
        more = check.problems_total - check.suppressed(hidden) - min(len(roots), SHOWN_PER_CHECK)
        if more > 0:
            where.print(f"  ... and {more} more (--json lists up to 1000 a check)")


__all__ = ["verify"]
