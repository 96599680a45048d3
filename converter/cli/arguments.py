"""What the commands take: the options several commands share, each declared once, and
the path arguments, every one of every command looked up once, by one resolver, before
the command does anything with it.

Shared options: `--json`, `--quiet`, `--progress`, `--workers`, `--manifest` and `--seed`
are declared here, once each (as huggingface_hub's CLI declares its common options once),
and every command that takes one uses its declaration: the same spelling, destination,
type and help. Where a command's default must differ, the declaration says why; where the
help names what the option acts on (the summary, the report), the command passes that
noun, never the help.

A path the OS refuses to look up (a name or a path too long: ENAMETOOLONG; a link loop:
ELOOP; any other error of stat but "not there") is a problem of the argument, coded
`path-unusable` and naming it, instead of an exception from whichever call first touches
it. A path that is not there passes: whether it must be there is the command's to say,
but one that could never be made (a name too long for its filesystem) is refused now.
Commands declare such a parameter with `PathArg`; `resolve_params` judges them all
(`console.run_guarded` calls it first, so `--json` gets its document; a command
without it calls `console.guard_paths`).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from .. import fsio
from ..errors import Fatal, Problem, message, problem
from ..reasons import Code

# What lets a command judge a path that is there or not itself: not the lookup's problem.
_COMMAND_JUDGES = {errno.ENOENT, errno.ENOTDIR, errno.EACCES, errno.EPERM}


class PathArg(click.Path):
    """A path parameter (click's `Path`, same options). One the OS refuses to look up is
    passed on as given, for `resolve_params` to refuse when the command starts (where
    `--json` can still print its document), not worded by click as "does not exist"."""

    def convert(self, value, param, ctx):  # type: ignore[override]
        if _judge(Path(os.fsdecode(value)), "") is not None:
            return self.coerce_path_result(value)
        return super().convert(value, param, ctx)


def path_problem(path: Path, argument: str) -> Problem | None:
    """Why the OS refuses to look `path` up (None: it is there, or simply not)."""
    judged = _judge(path, argument)
    return None if judged is None else judged[0]


def _judge(path: Path, argument: str) -> tuple[Problem, str] | None:
    """The problem and its rule (which names the hint), or None."""
    try:
        os.stat(path.expanduser())
    except OSError as exc:
        if exc.errno not in _COMMAND_JUDGES:
            return _problem(path, argument, exc.errno, exc.strerror or str(exc))
    except ValueError as exc:  # a NUL byte: no OS call can take it
        return _problem(path, argument, None, str(exc))
    else:
        return None
    return _too_long_to_make(path.expanduser(), argument)


def _too_long_to_make(path: Path, argument: str) -> tuple[Problem, str] | None:
    """A path not there whose names or length its filesystem could never hold: lookup
    stops at the first missing folder, so the names after it are measured here."""
    name_max, path_max = _limits(fsio.nearest_existing(path))
    # Not `abspath`: it drops "name/.." lexically, while the OS (or `mkdir -p`) meets the
    # name on the way.
    absolute = os.path.join(os.getcwd(), path)
    longest = max((len(os.fsencode(p)) for p in Path(absolute).parts), default=0)
    if longest > name_max or len(os.fsencode(absolute)) >= path_max:
        return _problem(path, argument, errno.ENAMETOOLONG, os.strerror(errno.ENAMETOOLONG))
    return None


def _limits(base: Path) -> tuple[int, int]:
    try:
        return os.pathconf(base, "PC_NAME_MAX"), os.pathconf(base, "PC_PATH_MAX")
    except (OSError, ValueError):
        return 255, 4096


def _problem(path: Path, argument: str, code: int | None, error: str) -> tuple[Problem, str]:
    shown = os.fsdecode(path)
    if code == errno.ELOOP:
        return problem(
            Code.PATH_UNUSABLE, rule="loop", file=shown, argument=argument, error=error
        ), "loop"
    if code == errno.ENAMETOOLONG:
        name_max, path_max = _limits(fsio.nearest_existing(path))
        return problem(
            Code.PATH_UNUSABLE,
            rule="too-long",
            file=shown,
            argument=argument,
            error=error,
            name_max=name_max,
            path_max=path_max,
        ), "too-long"
    return problem(Code.PATH_UNUSABLE, rule="os", file=shown, argument=argument, error=error), "os"


def resolve_params(ctx: click.Context | None) -> None:
    """Every `PathArg` parameter of the running command, judged together; raises `Fatal`
    with one problem per argument refused."""
    if ctx is None:
        return
    judged = []
    for param in ctx.command.params:
        if not isinstance(param.type, PathArg) or param.name is None:
            continue
        value = ctx.params.get(param.name)
        values = value if isinstance(value, tuple | list) else (value,)
        label = param.opts[0] if param.param_type_name == "option" else param.metavar
        for v in values:
            found = None if v is None else _judge(Path(v), label or param.name.upper())
            if found is not None:
                judged.append(found)
    if judged:
        hints = dict.fromkeys(message(Code.PATH_UNUSABLE, rule).hint for _, rule in judged)
        raise Fatal([p for p, _ in judged], hint="; ".join(h for h in hints if h) or None)


# --------------------------------------------------------------------------------------
# Options several commands share: one declaration each
# --------------------------------------------------------------------------------------

PROGRESS_MODES = ("auto", "bar", "lines", "none")
# How many files a command handles at once, by what it does with each: convert writes
# shards (CPU-bound: 0 picks one per two CPU cores, up to 8, on the machine that runs it);
# verify reads whole files through at most two 8 MiB buffers each (I/O-bound: 2 keep a
# disk busy, and a fixed number keeps verify's memory the same on every machine).
WORKERS = {"convert": 0, "verify": 2}


class SharedOption(click.Option):
    """An option declared in this module (tests/test_cli_options.py holds every option two
    commands take to one of these)."""


Decorator = Callable[[Callable[..., Any]], Callable[..., Any]]


def _shared(*decls: str, **attrs: Any) -> Decorator:
    return click.option(*decls, cls=SharedOption, **attrs)


def json_option(what: str) -> Decorator:
    """`--json`: the command's result as one JSON document on stdout; a refusal is the same
    document in every command. `what`: what the document holds here."""
    return _shared(
        "--json",
        "as_json",
        is_flag=True,
        help=f"Print {what} as one JSON document on stdout (a refusal: its problems, each "
        "with its code, as every command prints them).",
    )


def quiet_option(what: str) -> Decorator:
    """`--quiet`/`-q`: only problems are printed. `what`: what is not printed here."""
    return _shared("--quiet", "-q", is_flag=True, help=f"No progress and no {what}: problems only.")


def progress_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`--progress`: how every long-running command shows it."""
    return _shared(
        "--progress",
        "progress_mode",
        type=click.Choice(PROGRESS_MODES),
        default="auto",
        show_default=True,
        help="bar: live bar; lines: a plain line every 30 s (logs, nohup); none; auto: "
        "bar on a terminal, lines otherwise, none with --json when stderr is stdout's file. "
        "Always on stderr: --json on stdout stays clean.",
    )(fn)


def workers_option(command: str, what: str, note: str = "", here: int | None = None) -> Decorator:
    """`--workers N`: how many `what` `command` handles at once (`note`: what each holds);
    its default is `WORKERS[command]` (why they differ: above), 0 where it means "picked
    for this machine" (`here`: what that is)."""
    default = WORKERS[command]
    shown = f"{default}, which is {here} here" if default == 0 else str(default)
    auto = "; 0 means one per two CPU cores, up to 8" if default == 0 else ""
    return _shared(
        "--workers",
        type=click.IntRange(0 if default == 0 else 1),
        default=default,
        metavar="N",
        help=f"{what} at once{note}{auto} [default: {shown}].",
    )


def manifest_option(default: str | None, when_none: str = "") -> Decorator:
    """`--manifest`: the rules a checkpoint is held to. convert defaults to the official
    model's (a conversion is of Kimi-K3 unless told otherwise); verify to None, the one
    the output records (it says what it was converted against: `when_none`)."""
    otherwise = f" [default: {when_none}]" if default is None else ""
    return _shared(
        "--manifest",
        type=PathArg(path_type=str),
        default=default,
        show_default=default is not None,
        metavar="NAME_OR_PATH",
        help="What the checkpoint must look like: kimi-k3 (the official model, dims "
        "pinned), kimi-k3-any (dims from the config; scaled-down checkpoints such as "
        f"synth's) or a path to a manifest JSON{otherwise}.",
    )


def seed_option(what: str, default: int | None) -> Decorator:
    """`--seed N`: the seed of `what`; the same seed gives the same result. synth's default
    is 0; verify's None, so a seed given without --numerics is refused (it would seed
    nothing), and 0 is used with it."""
    return _shared(
        "--seed",
        type=int,
        default=default,
        show_default=default is not None,
        metavar="N",
        help=f"Seed of {what}: the same seed gives the same result"
        + (" [default: 0]." if default is None else "."),
    )
