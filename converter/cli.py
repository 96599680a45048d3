"""The `kimi-convert` command line: click for parsing, rich for progress and reports.

Exit codes scripts can rely on: 0 success, 1 invalid input or a failed check,
2 usage error, 130 interrupted (rerun the same command to resume).
"""

from __future__ import annotations

import atexit
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

import click
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.table import Table

from kimi_w31 import __version__

from .backends import hub_and_cluster_options, make_backend
from .convert import ConvertOptions, Reporter, convert, default_workers
from .errors import ConvertError
from .manifest import DEFAULT_MANIFEST
from .plan import DEFAULT_MAX_SHARD_SIZE

err = Console(stderr=True, soft_wrap=True)  # no hard wraps: messages stay greppable
out = Console()

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m[2].upper() not in _UNITS:
        raise click.BadParameter(
            f"size {text!r} not understood; use a number with a unit such as 500MB, 5GB or 4GiB"
        )
    return int(float(m[1]) * _UNITS[m[2].upper()])


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return str(n)


def render_error(exc: ConvertError, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps({"ok": False, "problems": [p.as_dict() for p in exc.problems],
                                   "hint": exc.hint}))  # fmt: skip
        return
    shown = exc.problems[:50]
    err.print(f"[bold red]error:[/] {escape(exc.summary())}")
    if len(exc.problems) > 1 or exc.problems[0].expected is not None:
        for p in shown:
            err.print(f"  [red]-[/] {escape(p.render())}", highlight=False, soft_wrap=True)
        if len(exc.problems) > len(shown):
            err.print(f"  ... and {len(exc.problems) - len(shown)} more")
    if exc.hint:
        err.print(f"[yellow]hint:[/] {escape(exc.hint)}")


def run_guarded(fn, as_json: bool = False) -> None:
    """Run a command body; turn errors into messages and exit codes, never tracebacks."""
    try:
        fn()
    except ConvertError as exc:
        render_error(exc, as_json)
        sys.exit(exc.exit_code)
    except KeyboardInterrupt:
        err.print("[yellow]interrupted.[/] Rerun the same command to resume: finished shards "
                  "are kept.")  # fmt: skip
        sys.exit(130)
    except click.exceptions.Exit:
        raise
    except Exception as exc:  # a bug or an unexpected OS error: say what, not a traceback
        if os.environ.get("KIMI_W31_DEBUG"):
            raise
        err.print(f"[bold red]error:[/] {type(exc).__name__}: {escape(str(exc))}")
        err.print("set KIMI_W31_DEBUG=1 for the full traceback")
        sys.exit(1)


class RichReporter(Reporter):
    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.progress: Progress | None = None
        self.task = None
        self.shards_total = 0
        self.shards_done = 0
        self.lock = threading.Lock()

    def start(self, total_bytes: int, shards: int) -> None:
        self.shards_total = shards
        if self.quiet:
            return
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
            TransferSpeedColumn(), TimeRemainingColumn(), console=err, transient=False,
        )  # fmt: skip
        self.progress.start()
        self.task = self.progress.add_task(self._label(), total=total_bytes)

    def _label(self) -> str:
        return f"shards {self.shards_done}/{self.shards_total}"

    def advance(self, nbytes: int) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=nbytes)

    def shard_done(self, name: str, reused: bool) -> None:
        with self.lock:
            self.shards_done += 1
        if self.progress is not None:
            self.progress.update(self.task, description=self._label())

    def warn(self, message: str) -> None:
        err.print(f"[yellow]warning:[/] {escape(message)}")

    def stop(self) -> None:
        if self.progress is not None:
            self.progress.stop()


class DefaultConvert(click.Group):
    """`kimi-convert SRC OUT` means `kimi-convert convert SRC OUT`."""

    def resolve_command(self, ctx, args):
        if args and args[0] not in self.commands and not args[0].startswith("-"):
            args = ["convert", *args]
        return super().resolve_command(ctx, args)

    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h", "--version"):
            args = ["convert", *args]
        return super().parse_args(ctx, args)


@click.group(cls=DefaultConvert, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kimi-convert")
def main() -> None:
    """Convert Kimi-K3 MXFP4 checkpoints to the fused [up; gate] (w31) expert layout.

    \b
    Examples:
      kimi-convert /data/hf_models/Kimi-K3 out/         convert a local checkpoint
      kimi-convert moonshotai/Kimi-K3 out/              a repo already in the HF cache
      kimi-convert SRC out/ --dry-run                   check and plan only, write nothing
      kimi-convert SRC out/ --manifest kimi-k3-any      scaled-down checkpoints
      kimi-convert verify out/ --checksums              prove an output intact
      kimi-convert synth src/ --layers 3 --experts 8    make a checkpoint to play with

    Exit codes: 0 ok, 1 invalid input or failed check, 2 usage error, 130 interrupted.
    """


@main.command("convert")
@click.argument("source")
@click.argument("output", type=click.Path(path_type=Path))
@click.option(
    "--manifest",
    default=DEFAULT_MANIFEST,
    show_default=True,
    help="Manifest name (kimi-k3: official dims pinned; kimi-k3-any: dims from the "
    "config) or a path to a manifest JSON.",
)
@click.option("--revision", default=None, help="Revision of a Hugging Face repo id source.")
@click.option(
    "--max-shard-size",
    default="5GB",
    show_default=True,
    callback=lambda c, p, v: parse_size(v),
    help="Largest output shard (e.g. 500MB, 5GB, 4GiB).",
)
@click.option(
    "--workers",
    type=click.IntRange(0),
    default=0,
    help=f"Shards written at once [default: {default_workers()} here].",
)
@click.option("--dry-run", is_flag=True, help="Check and plan only; print what would be written.")
@click.option(
    "--force",
    is_flag=True,
    help="Replace a previous, different conversion in OUTPUT (only files it wrote).",
)
@click.option(
    "--check-scales",
    is_flag=True,
    help="Also scan every E8M0 scale byte for 0xFF (NaN) while copying.",
)
@click.option("--quiet", "-q", is_flag=True, help="No progress bar or summary table.")
@click.option("--json", "as_json", is_flag=True, help="Print a machine-readable JSON summary.")
@hub_and_cluster_options
def convert_cmd(source, output, manifest, revision, max_shard_size, workers, dry_run, force,
                check_scales, quiet, as_json, **backend_opts) -> None:  # fmt: skip
    """Convert SOURCE (a directory or a cached HF repo id) into OUTPUT.

    Every expert tensor is checked against the manifest from headers alone before anything
    is written. Each expert's w1 (gate) and w3 (up) become one w31 = [up; gate] tensor by
    byte concatenation; everything else is copied unchanged. Interrupted runs resume when
    the same command is run again.
    """
    opts = ConvertOptions(
        source=source, out=output, manifest=manifest, revision=revision,
        max_shard_size=max_shard_size or DEFAULT_MAX_SHARD_SIZE, workers=workers,
        dry_run=dry_run, force=force, check_scales=check_scales,
    )  # fmt: skip

    def body() -> None:
        opts.backend = make_backend(**backend_opts)
        reporter = RichReporter(quiet or as_json)
        result = convert(opts, reporter)
        keep_until_exit(result)
        summary = result.summary()
        if opts.backend:
            summary.update(opts.backend.plan_summary(result.source, result.plan))
        if as_json:
            out.print_json(json.dumps({"ok": True, **summary}))
            return
        if quiet:
            return
        if dry_run:
            _print_plan(result, opts.backend.plan_rows(result.source, result.plan)
                        if opts.backend else [])  # fmt: skip
            return
        if result.already_complete:
            err.print(f"[green]already complete:[/] {result.out} holds this conversion; "
                      "nothing to do.")  # fmt: skip
            return
        _print_summary(summary)

    run_guarded(body, as_json)


def _print_plan(result, extra_rows: list[tuple[str, str]] = ()) -> None:
    plan = result.plan
    table = Table(title="Plan (dry run: nothing written)", show_header=False)
    table.add_row("source", result.source.label)
    table.add_row("output", str(result.out))
    table.add_row("source shards", str(len(result.source.shard_files)))
    table.add_row("MoE layers", str(len(plan.layers)))
    table.add_row("experts fused (w1+w3 -> w31)", str(plan.experts_fused))
    table.add_row("output tensors", str(plan.tensors_copied))
    table.add_row("output shards", str(len(plan.shards)))
    table.add_row("space needed", human(plan.output_bytes))
    table.add_row("dims", ", ".join(f"{k}={v}" for k, v in plan.dims.values.items()))
    for label, value in extra_rows:
        table.add_row(label, value)
    out.print(table)
    for shard in plan.shards[:5]:
        out.print(f"  {shard.name}: {len(shard.tensors)} tensors, {human(shard.file_size)}")
    if len(plan.shards) > 5:
        out.print(f"  ... {len(plan.shards) - 5} more shards")


def _print_summary(summary: dict) -> None:
    table = Table(title="Conversion complete", show_header=False)
    table.add_row("output", summary["output"])
    table.add_row("shards written / kept", f"{summary['shards_written']} / "
                  f"{summary['shards_reused']}")  # fmt: skip
    table.add_row("tensors", str(summary["tensors"]))
    table.add_row("experts fused", str(summary["experts_fused"]))
    table.add_row("bytes", human(summary["output_bytes"]))
    table.add_row("time", f"{summary['seconds']:.2f} s")
    if summary["throughput_mb_s"]:
        table.add_row("throughput", f"{summary['throughput_mb_s']} MB/s")
    out.print(table)
    out.print("next: [bold]kimi-convert verify " + summary["output"] + "[/]")


@main.command()
@click.argument("output", type=click.Path(path_type=Path))
@click.option("--layers", default=3, show_default=True, type=click.IntRange(1))
@click.option("--experts", default=8, show_default=True, type=click.IntRange(1))
@click.option("--top-k", default=2, show_default=True, type=click.IntRange(1))
@click.option("--shards", default=3, show_default=True, type=click.IntRange(1))
@click.option("--real-dims", is_flag=True, help="True per-expert shapes (K 3584, N 3072).")
@click.option(
    "--k",
    "k",
    type=click.IntRange(32),
    default=None,
    help="routed_expert_hidden_size (multiple of 32) [default: 128, 3584 with --real-dims].",
)
@click.option(
    "--n",
    "n",
    type=click.IntRange(32),
    default=None,
    help="moe_intermediate_size (multiple of 32) [default: 64, 3072 with --real-dims].",
)
@click.option("--seed", default=0, show_default=True)
def synth(output, layers, experts, top_k, shards, real_dims, k, n, seed) -> None:
    """Write a synthetic Kimi-K3-format source checkpoint to OUTPUT."""
    from .synth import REAL_K, REAL_N, SynthSpec, synth_checkpoint

    def body() -> None:
        kk = k or (REAL_K if real_dims else 128)
        nn = n or (REAL_N if real_dims else 64)
        if kk % 32 or nn % 32:
            raise click.UsageError("--k and --n must be multiples of 32 (the MXFP4 group size)")
        spec = SynthSpec(layers=layers, experts=experts, k=kk, n=nn, top_k=min(top_k, experts),
                         shards=shards, seed=seed, hidden=1024 if real_dims else 256)  # fmt: skip
        started = time.perf_counter()
        info = synth_checkpoint(output, spec)
        err.print(f"wrote {output}: {info['tensors']} tensors in {info['shards']} shards, "
                  f"{human(info['bytes'])} in {time.perf_counter() - started:.1f} s "
                  f"(K={kk}, N={nn}, {experts} experts x {layers} layers)")  # fmt: skip

    run_guarded(body)


_kept: list[object] = []
_exiting_fast = False


def keep_until_exit(obj: object) -> None:
    """Under the console command, never free `obj`: see `run`."""
    if _exiting_fast:
        _kept.append(obj)


def run() -> None:
    """The `kimi-convert` console command: `main`, then a quick exit.

    A plan of the real model is ~2M small Python objects, and freeing them one by one when
    the process ends anyway takes ~0.25 s. The command keeps its result alive, runs the exit
    handlers, flushes its output and leaves with os._exit, unless a thread is still running.
    (`main` itself, as used in-process, frees everything as usual.)
    """
    global _exiting_fast
    _exiting_fast = True
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    if threading.active_count() > 1:  # someone's thread still runs: the ordinary way out
        sys.exit(code)
    if not isinstance(code, int):  # sys.exit("message") or sys.exit(None)
        if code is not None:
            print(code, file=sys.stderr)
        code = 0 if code is None else 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _register_optional_commands() -> None:
    from kimi_w31.adapter.launch import serve  # metadata checks only: never imports SGLang

    from .verify_cli import verify

    main.add_command(verify)
    main.add_command(serve)


_register_optional_commands()
