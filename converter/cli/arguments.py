"""Path arguments: every one of every command is looked up once, by one resolver, before
the command does anything with it.

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
from pathlib import Path

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
