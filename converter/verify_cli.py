"""The `verify` subcommand: run the levels, show one line per check, exit 0/1/2."""

from __future__ import annotations

import json
from pathlib import Path

import click
from rich.markup import escape
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn
from rich.table import Table

from .verify import verify as run_verify


@click.command()
@click.argument("output", type=click.Path(path_type=Path, exists=True, file_okay=False))
@click.option("--checksums", is_flag=True, help="Re-hash every byte against the conversion record.")
@click.option("--source", default=None, help="Compare every tensor with the source checkpoint.")
@click.option(
    "--numerics",
    is_flag=True,
    help="Compute sampled experts from source and converted semantics (needs --source and torch).",
)
@click.option(
    "--experts",
    default=8,
    show_default=True,
    type=click.IntRange(1),
    help="How many experts --numerics samples.",
)
@click.option("--all", "all_experts", is_flag=True, help="--numerics on every expert.")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--manifest",
    default=None,
    help="Manifest to check against [default: the one recorded in config.json].",
)
@click.option("--workers", default=2, show_default=True, type=click.IntRange(1))
@click.option("--json", "as_json", is_flag=True, help="Machine-readable report on stdout.")
@click.option("--quiet", "-q", is_flag=True, help="Only the exit code and problems.")
def verify(output, checksums, source, numerics, experts, all_experts, seed, manifest, workers,
           as_json, quiet) -> None:  # fmt: skip
    """Prove a converted checkpoint in OUTPUT complete, intact and correct.

    \b
    Levels (each includes the ones above it):
      (default)     structure: headers, index, expert shapes, kimi_w31 block; seconds
      --checksums   integrity: re-hash every tensor; reports the first corrupt file/tensor
      --source SRC  every w31 == concat([w3, w1]) of SRC, everything else byte-identical
      --numerics    sampled experts computed both ways agree (needs --source)

    Exit codes: 0 all checks passed, 1 problems found, 2 usage error.
    """
    from .cli import err, out, run_guarded

    if numerics and not source:
        raise click.UsageError("--numerics compares against the source: pass --source SRC too")

    def body() -> None:
        reads = checksums or source or numerics
        progress = None
        if reads and not (as_json or quiet):
            progress = Progress(TextColumn("[bold]verifying"), BarColumn(), DownloadColumn(),
                                TransferSpeedColumn(), console=err, transient=True)  # fmt: skip
            progress.start()
            task = progress.add_task("verify", total=None)
        try:
            report = run_verify(
                output, manifest=manifest, checksums=bool(reads), source=source,
                numerics=numerics, sample=None if all_experts else experts, seed=seed,
                workers=workers,
                on_bytes=(lambda n: progress.update(task, advance=n)) if progress else None,
            )  # fmt: skip
        finally:
            if progress:
                progress.stop()
        if as_json:
            out.print_json(json.dumps(report.as_dict()))
        else:
            _render(report, quiet)
        raise SystemExit(0 if report.ok else 1)

    run_guarded(body, as_json)


def _render(report, quiet: bool) -> None:
    from .cli import err, out

    if not quiet:
        table = Table(title=f"verify {report.output}")
        table.add_column("check")
        table.add_column("result")
        table.add_column("detail")
        for c in report.checks:
            mark = "[green]ok[/]" if c.ok else "[red]FAIL[/]" if c.ok is False else "skipped"
            table.add_row(c.name, mark, c.detail)
        out.print(table)
    for c in report.checks:
        for p in c.problems[:20]:
            err.print(f"  [red]-[/] {escape(f'[{c.name}] {p.render()}')}", highlight=False,
                      soft_wrap=True)  # fmt: skip
        if len(c.problems) > 20:
            err.print(f"  ... and {len(c.problems) - 20} more in {c.name}")
    if not quiet:
        verdict = "[bold green]PASS[/]" if report.ok else "[bold red]FAIL[/]"
        out.print(f"{verdict}: {sum(1 for c in report.checks if c.ok)} of {len(report.checks)} "
                  "checks passed")  # fmt: skip
