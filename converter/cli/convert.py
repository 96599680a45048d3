"""The converter's command `convert` (the command line is `kimi_w31.cli`).

click parses, `pipeline.convert` works, `console` renders. Exit codes: 0 ok, 1 invalid
input or a failed check, 2 usage error, 130 interrupted, 143 terminated.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import click
from rich.errors import LiveError
from rich.markup import escape
from rich.table import Table

from ..errors import EXIT_OK, fatal
from ..execute import Executor
from ..execute.local import LocalExecutor, default_workers
from ..execute.shard import Outcome, ShardOutcome
from ..manifest import DEFAULT_MANIFEST
from ..output.records import Mode
from ..pipeline import ConvertOptions, ConvertResult, Reporter, convert, gc_paused
from ..reasons import Code
from ..text import plural, repair_command
from . import console
from .arguments import (
    PathArg,
    json_option,
    manifest_option,
    progress_option,
    quiet_option,
    workers_option,
)
from .console import err, human, out, parse_size, run_guarded

RESUME_HINT = "rerun the same command to resume: finished shards are kept"


class ProgressReporter(Reporter):
    """Conversion progress: output bytes settled (written, or kept from an earlier run once
    proven), shards done, and what was kept. With --download, a second quantity beside it:
    source bytes arriving from the Hub (`download_*`, the executor's `DownloadProgress`), a
    second bar or its own `download: ...` lines.

    Each shard counts its size once, however often its bytes flow: proving a kept shard
    with --rehash re-reads it, a shard that fails that proof is read and then written.
    Bytes flowing count at once (so a large shard moves the bar) but only up to what is
    left; a settled shard's size replaces what flowed for it. Never past 100 %, never
    backwards, exactly 100 % when every shard is done."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.progress: console.Progress | None = None
        self.download: console.Progress | None = None
        self.shards = 0
        self.done = self.kept = 0
        self.files = self.fetched = 0
        self.total = 0
        self.settled = 0  # bytes of the shards done
        self.flowed = 0  # bytes read or written not yet matched to a done shard
        self.shown = 0  # what the progress says is done
        self.lock = threading.Lock()

    def start(self, total_bytes: int, shards: int) -> None:
        self.shards, self.total = shards, total_bytes
        self.progress = console.Progress(self.mode, "convert", total_bytes)
        self.progress.note(shards=f"0/{shards}")

    def _recount(self) -> int:
        """How much further the shown figure moves (under the lock)."""
        shown = min(self.total, self.settled + min(self.flowed, self.total - self.settled))
        step, self.shown = max(0, shown - self.shown), max(shown, self.shown)
        return step

    def advance(self, nbytes: int) -> None:
        with self.lock:
            self.flowed += nbytes
            step = self._recount()
        if self.progress is not None:
            self.progress.add(step, nbytes)

    def shard_done(self, result: ShardOutcome) -> None:
        size = result.record.size if result.record is not None else 0
        with self.lock:
            self.done += 1
            if result.outcome is Outcome.KEPT:
                self.kept += 1
            self.settled += size
            self.flowed -= min(self.flowed, size)
            step = self._recount()
            note = f"{self.done}/{self.shards}" + (f" ({self.kept} kept)" if self.kept else "")
        if self.progress is not None:
            self.progress.add(step, 0)
            self.progress.note(shards=note)

    def warn(self, message: str) -> None:
        err.print(f"[yellow]warning:[/] {escape(message)}")

    def stop(self) -> None:
        self.download_stop()
        if self.progress is not None:
            self.progress.stop()

    def download_start(self, total_bytes: int, files: int) -> None:
        self.files = files
        if not files:  # every source shard needed is already here: nothing to show
            return
        try:
            self.download = console.Progress(self.mode, "download", total_bytes)
        except LiveError:  # a rich without nested live displays: lines beside the bar
            self.download = console.Progress("lines", "download", total_bytes)
        self.download.note(files=f"0/{files}")

    def download_advance(self, nbytes: int) -> None:
        download = self.download  # read once: download threads race `download_stop`
        if download is not None:
            download.advance(nbytes)
        if self.progress is not None:  # its elapsed time keeps moving while it waits for
            self.progress.note()  # the first source shards

    def download_file_done(self, file: str, unreported: int) -> None:
        with self.lock:
            self.fetched += 1
            note = f"{self.fetched}/{self.files}"
        download = self.download
        if download is not None:
            if unreported:
                download.advance(unreported, moved=False)
            download.note(files=note)

    def download_stop(self) -> None:
        # Before the output bar stops: the download bar is the nested live display.
        download, self.download = self.download, None
        if download is not None:
            download.stop()


def _hub_and_cluster_options(fn):
    """Options for streaming from the Hub (`--download`) and for Ray (`--executor ray`)."""
    options = [
        click.option(
            "--download",
            is_flag=True,
            help="SOURCE is a Hub repo id: read headers over HTTP, download source "
            "shards as the plan needs them (token: HF_TOKEN or hf auth login).",
        ),
        click.option(
            "--download-dir",
            type=PathArg(path_type=Path),
            default=None,
            metavar="DIR",
            help="With --download: put source files in DIR instead of the HF cache.",
        ),
        click.option(
            "--delete-source-shards",
            is_flag=True,
            help="With --download: delete each source shard once every output shard "
            "reading it is done (peak disk = output + window).",
        ),
        click.option(
            "--max-source-window",
            type=click.IntRange(1),
            default=None,
            metavar="N",
            help="With --download: source shards live at once (downloading or "
            "waiting to be used) [default: 4]. --dry-run prints the smallest that "
            "works.",
        ),
        click.option(
            "--executor",
            type=click.Choice(["local", "ray"]),
            default="local",
            show_default=True,
            help="Who writes the shards: threads here, or Ray tasks on a cluster "
            "(source and output on storage every node sees).",
        ),
        click.option(
            "--ray-address",
            default=None,
            metavar="HOST:PORT",
            help="With --executor ray: the cluster to join [default: RAY_ADDRESS, "
            "else a local Ray runtime].",
        ),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def _origin_and_executor(
    opts: ConvertOptions,
    workers: int,
    download: bool,
    download_dir: Path | None,
    delete_source_shards: bool,
    max_source_window: int | None,
    executor: str,
    ray_address: str | None,
) -> None:
    """Fill in where the source comes from and who writes the shards, or refuse the mix."""
    if not download:
        given = [
            name
            for name, v in (
                ("--download-dir", download_dir),
                ("--delete-source-shards", delete_source_shards),
                ("--max-source-window", max_source_window),
            )
            if v
        ]
        if given:
            raise fatal(Code.USAGE, rule="download-options", options=", ".join(given))
    if ray_address and executor != "ray":
        raise fatal(Code.USAGE, rule="ray-address")
    if executor == "ray":
        if download:
            raise fatal(Code.USAGE, rule="download-with-ray")
        from ..execute.ray import RayExecutor, import_ray

        import_ray()  # say so before anything else happens
        opts.executor = RayExecutor(address=ray_address)
    elif download:
        from ..execute.download import DEFAULT_WINDOW, DownloadExecutor
        from ..source.hub import HubOrigin

        opts.origin = HubOrigin(
            download_dir=download_dir.expanduser().resolve() if download_dir else None
        )
        opts.executor = DownloadExecutor(
            window=max_source_window or DEFAULT_WINDOW,
            delete_source_shards=delete_source_shards,
            workers=workers or default_workers(),
        )
    else:
        opts.executor = LocalExecutor(workers)


@click.command("convert")
@click.argument("source", metavar="SRC_DIR_OR_REPO_ID", type=PathArg(path_type=str))
@click.argument("output", metavar="OUT_DIR", type=PathArg(path_type=Path))
@manifest_option(DEFAULT_MANIFEST)
@click.option(
    "--revision",
    default=None,
    metavar="REV",
    help="Branch, tag or commit of a Hugging Face repo id source.",
)
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    metavar="SIZE",
    callback=lambda c, p, v: parse_size(v),
    help="Largest output shard (e.g. 500MB, 5GB, 4GiB); must be more than 0.",
)
@workers_option("convert", "Shards written", here=default_workers())
@click.option(
    "--dry-run",
    is_flag=True,
    help="Check and plan only; show what would be written, kept or redone.",
)
@click.option(
    "--force",
    is_flag=True,
    help="Replace a different, earlier conversion in OUT_DIR: removes only the files "
    "kimi-convert's own records say it wrote there; refuses anything else.",
)
@click.option(
    "--rehash",
    is_flag=True,
    help="Before keeping a shard an earlier run finished, re-read it and compare "
    "every tensor's checksum [default: size, header and source identity only].",
)
@click.option(
    "--check-scales",
    is_flag=True,
    help="Also scan U8 '*.weight_scale' tensors outside the routed experts for 0xFF (NaN) "
    "E8M0 bytes. Routed-expert U8 scales and F8_E8M0 tensors are always scanned while "
    "copying (nearly free); F32/BF16 scales never are.",
)
@progress_option
@quiet_option("summary")
@json_option("the summary")
@_hub_and_cluster_options
def convert_cmd(
    source,
    output,
    manifest,
    revision,
    max_shard_size,
    workers,
    dry_run,
    force,
    rehash,
    check_scales,
    progress_mode,
    quiet,
    as_json,
    **where,
) -> None:
    """Convert SRC_DIR_OR_REPO_ID (a directory, or a repo id in the HF cache or, with
    --download, on the Hub) into OUT_DIR.

    Every expert tensor is checked against the manifest from headers alone before anything
    is written. Each expert's w1 (gate) and w3 (up) become one w31 = [up; gate] tensor by
    byte concatenation; everything else is copied unchanged; the index is written last.

    Rerun the same command after any interruption: finished shards are kept once proven.
    On a finished output it proves every shard again and rewrites what fails the proof
    (size, header, source identity; with --rehash also every tensor's data).

    \b
    Examples:
      kimi-convert /data/Kimi-K3 /data/Kimi-K3-w31
      kimi-convert /data/Kimi-K3 out/ --dry-run              plan; what a rerun would keep
      kimi-convert moonshotai/Kimi-K3 out/ --download --delete-source-shards
      kimi-convert /shared/Kimi-K3 /shared/out --executor ray --ray-address HEAD:6379
      nohup kimi-convert SRC out/ --progress lines > convert.log 2>&1 &
    """

    def body() -> None:
        opts = ConvertOptions(
            source=source,
            out=output,
            manifest=manifest,
            revision=revision,
            max_shard_size=max_shard_size,
            dry_run=dry_run,
            force=force,
            check_scales=check_scales,
            rehash=rehash,
        )
        _origin_and_executor(opts, workers, **where)
        mode = console.resolve_mode(progress_mode, quiet, as_json)
        reporter = ProgressReporter(mode)
        opts.executor.download_progress = reporter  # --download: bytes from the Hub
        # The GC stays off until the plan is gone too: re-enabled over ~2M live objects,
        # its first collection alone would rescan them all (see `gc_paused`).
        with gc_paused():
            report(convert(opts, reporter), opts.executor, reporter)

    def report(result: ConvertResult, executor: Executor, reporter: ProgressReporter) -> None:
        summary = {**result.summary(), **executor.summary(result.plan)}
        if reporter.progress is not None and summary.get("throughput_mb_s"):
            # the progress lines' own figure: bytes this run moved over the time they took
            rate = reporter.progress.rate()
            summary["throughput_mb_s"] = round(rate / 1e6, 1)
            summary["throughput_bytes_s"] = round(rate)
        if result.already_complete and not summary["kept_data_reread"]:
            # kept shards proven without their data: damage verify found is not seen here
            summary["repair"] = repair_command(str(output), source)
        if as_json:
            out.print_json(json.dumps({"ok": True, "exit_code": EXIT_OK, **summary}))
        elif quiet:
            return
        elif dry_run:
            _print_plan(result, executor.plan_rows(result.plan))
        elif result.already_complete:
            err.print(
                f"[green]already complete:[/] {escape(str(result.out))} holds this "
                f"conversion; {plural(len(result.plan.shards), 'shard')} proven by "
                f"{summary['kept_proven_by']}; nothing rewritten."
            )
            if summary.get("repair"):  # the data was not re-read: say what would be
                err.print(
                    "[yellow]hint:[/] if `kimi-convert verify --checksums` failed, this run "
                    f"could not see it; repair with: {escape(summary['repair'])}"
                )
        else:
            _print_summary(result, summary)

    run_guarded(body, as_json, interrupted=RESUME_HINT)


def _print_plan(result: ConvertResult, extra_rows: list[tuple[str, str]]) -> None:
    plan, preview = result.plan, result.preview
    table = Table(title="Plan (dry run: nothing written)", show_header=False)
    table.add_row("source", str(result.source.root))
    table.add_row("output", str(result.out))
    table.add_row("source shards", str(len(result.source.shard_files)))
    table.add_row("MoE layers", str(len(plan.layers)))
    table.add_row("experts fused (w1+w3 -> w31)", str(plan.experts_fused))
    table.add_row("output tensors", str(plan.tensors))
    table.add_row("output shards", str(len(plan.shards)))
    table.add_row("space needed", human(plan.output_bytes))
    if result.space is not None:
        to_write, free = result.space
        table.add_row("to write / free here", f"{human(to_write)} / {human(free)} (fits)")
    if result.estimate is not None:
        est = result.estimate
        when = "unknown" if est.seconds is None else f"about {console.duration(est.seconds)}"
        table.add_row("estimated time", f"{when} ({est.basis})")
    table.add_row("dims", ", ".join(f"{k}={v}" for k, v in plan.dims.values.items()))
    if preview is not None and preview.mode is not Mode.FRESH:
        what = "an interrupted run" if preview.mode is Mode.RESUME else "a finished output"
        table.add_row(
            "earlier run",
            f"{what}: {len(preview.keep)} shards would be kept, {len(preview.redo)} written",
        )
    for label, value in extra_rows:
        table.add_row(label, value)
    out.print(table)
    for shown, shard in enumerate(plan.shards):
        if shown == 5:
            out.print(f"  ... {len(plan.shards) - 5} more shards")
            break
        fate = ""
        if preview is not None and preview.mode is not Mode.FRESH:
            reason = preview.redo.get(shard.name)
            fate = " - keep" if reason is None else f" - write ({reason})"
        out.print(f"  {shard.name}: {len(shard.tensors)} tensors, {human(shard.file_size)}{fate}")


def _print_summary(result: ConvertResult, summary: dict) -> None:
    # "Repaired" only when every kept shard's data was re-read (`kept_data_reread`).
    title = "Conversion complete"
    if result.mode is Mode.RECHECK:
        title = "Output repaired" if summary["kept_data_reread"] else "Output updated"
    table = Table(title=title, show_header=False)
    table.add_row("output", summary["output"])
    table.add_row(
        "shards written / kept", f"{summary['shards_written']} / {summary['shards_kept']}"
    )
    table.add_row("bytes written this run", human(summary["bytes_written"]))
    if summary["bytes_kept"]:
        table.add_row("bytes kept from earlier runs", human(summary["bytes_kept"]))
    if summary["shards_kept"]:
        table.add_row("kept shards proven by", summary["kept_proven_by"])
    for shard, reason in list(summary["redone"].items())[:5]:
        table.add_row(f"redone {shard}", reason)
    table.add_row("tensors / experts fused", f"{summary['tensors']} / {summary['experts_fused']}")
    table.add_row("output size", human(summary["output_bytes"]))
    table.add_row("time", f"{summary['seconds']:.2f} s")
    if summary["throughput_mb_s"]:
        rate = summary.get("throughput_bytes_s", summary["throughput_mb_s"] * 1e6)
        table.add_row("throughput (this run)", f"{human(rate)}/s")
    out.print(table)
    out.print("next: [bold]kimi-convert verify " + escape(summary["output"]) + "[/]")
