"""Class: path arguments the OS refuses to look up (a name or a path too long, a link loop,
on the way or at the end) are refused by one resolver, as the argument's problem
(`path-unusable`, exit 2): never a traceback or the generic handler, and with `--json`
always a document. Every path parameter of every command is declared with `PathArg`."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import click
import faults as fl
import pytest
from cli_helpers import json_problems, run_cli
from hypothesis import given
from hypothesis import strategies as st
from kimi_w31.converter.cli.arguments import PathArg, path_problem
from kimi_w31.converter.errors import EXIT_USAGE
from kimi_w31.converter.reasons import Code

from kimi_w31.cli import main

COMMANDS = main.list_commands(click.Context(main))


def _command(name: str) -> click.Command:
    return main.get_command(click.Context(main), name)


def _path_params() -> list[tuple[str, str]]:
    return [
        (name, param.name)
        for name in COMMANDS
        for param in _command(name).params
        if isinstance(param.type, PathArg)
    ]


def test_every_path_parameter_of_every_command_is_a_patharg():
    """No path reaches a command without the resolver: click's own Path type (which words a
    loop as "does not exist") and untyped path-like arguments are not used."""
    untyped = {("convert", "source"), ("verify", "source"), ("convert", "manifest")}
    for name in COMMANDS:
        for param in _command(name).params:
            assert type(param.type) is not click.Path, (name, param.name)
            if (name, param.name) in untyped:
                assert isinstance(param.type, PathArg), (name, param.name)
    assert {c for c, _ in _path_params()} >= {"convert", "verify", "synth", "serve", "prebuild"}


def _hostile(tmp: Path) -> dict[str, str]:
    (tmp / "loopA").symlink_to("loopB")
    (tmp / "loopB").symlink_to("loopA")
    deep = tmp / "d"
    deep.mkdir()
    return {
        "a name too long": str(tmp / ("n" * 300)),
        "a name too long under a missing folder": str(tmp / "missing" / ("n" * 300)),
        "a path too long": str(tmp / "/".join(["p" * 200] * 25)),
        "a link loop": str(tmp / "loopA"),
        "a link loop on the way": str(tmp / "loopA" / "x"),
    }


def _argv(command: str, param: click.Parameter, value: str, ok: str) -> list[str]:
    """A command line with `value` for `param`, a usable path for every other required
    argument."""
    argv = [command]
    for p in _command(command).params:
        if isinstance(p, click.Argument) and p.nargs == 1:
            argv.append(value if p is param else ok)
    if isinstance(param, click.Option):
        argv += [param.opts[0], value]
    if any("--json" in p.opts for p in _command(command).params if isinstance(p, click.Option)):
        argv.append("--json")
    return argv


@pytest.mark.parametrize(("command", "param_name"), _path_params())
def test_a_path_the_os_refuses_is_the_arguments_problem(tmp_path, command, param_name):
    param = next(p for p in _command(command).params if p.name == param_name)
    as_json = any(
        "--json" in p.opts for p in _command(command).params if isinstance(p, click.Option)
    )
    for case, value in _hostile(tmp_path).items():
        result = run_cli(_argv(command, param, value, str(tmp_path)), inprocess=True)
        text = result.stdout + result.stderr
        assert result.exception is None or isinstance(result.exception, SystemExit), (case, text)
        assert not fl.looks_like_crash(text), (case, text)
        assert result.returncode == EXIT_USAGE, (case, text)
        if as_json:
            problems = json_problems(result.stdout)
            assert json.loads(result.stdout)["exit_code"] == EXIT_USAGE
            assert [p["code"] for p in problems] == [Code.PATH_UNUSABLE.value], (case, text)
            assert problems[0]["file"] == value
        else:
            assert (
                Code.PATH_UNUSABLE.value in text
                or "cannot be looked up" in text
                or ("too long" in text)
            ), (case, text)


def test_a_usable_path_passes_and_a_missing_one_is_left_to_the_command(tmp_path):
    """Negative controls: what is there, and what is simply not there, pass the resolver."""
    assert path_problem(tmp_path, "OUT_DIR") is None
    assert path_problem(tmp_path / "missing" / "out", "OUT_DIR") is None
    assert path_problem(Path("moonshotai/Kimi-K3"), "SRC") is None  # a repo id


_segment = st.one_of(
    st.sampled_from(["loopA", "loopB", "d", "missing", ".", ".."]),
    st.integers(1, 320).map(lambda n: "x" * n),
)


@fl.fuzz(60)
@given(parts=st.lists(_segment, min_size=1, max_size=20))
def test_the_resolver_never_raises_and_refuses_exactly_what_the_os_refuses(tmp_path_factory, parts):
    """Over generated paths: `path_problem` never raises; when it passes a path, looking it
    up gives the path or "not there" (and creating what is missing could succeed: no name
    over the limit); when it refuses, looking the path up, or making it, fails."""
    tmp = tmp_path_factory.getbasetemp() / "resolver"
    if not tmp.exists():
        tmp.mkdir()
        _hostile(tmp)
    path = tmp.joinpath(*parts)
    found = path_problem(path, "ARG")
    try:
        os.stat(path)
        looked_up = None
    except OSError as exc:
        looked_up = exc.errno
    too_long = any(len(p) > 255 for p in parts) or len(os.fsencode(str(path))) >= 4096
    if found is None:
        assert looked_up in (None, errno.ENOENT, errno.ENOTDIR), looked_up
        assert not too_long
    else:
        assert found.code is Code.PATH_UNUSABLE and found.file == str(path)
        assert looked_up not in (None,) or too_long


def test_the_fault_table_rows_are_clean(tmp_path):
    rows = fl.argument_cases(fl.make_source(tmp_path / "template"), tmp_path / "work")
    assert len(rows) >= 4 * 9
    assert not fl.bad_rows(rows, {fl.CLEAN}), fl.bad_rows(rows, {fl.CLEAN})


def test_a_name_too_long_before_dotdot_is_still_refused(tmp_path):
    """`name/..` is not collapsed away: creating the path meets the name first."""
    found = path_problem(tmp_path / "missing" / ("x" * 256) / "..", "OUT_DIR")
    assert found is not None and found.code is Code.PATH_UNUSABLE
    assert path_problem(tmp_path / "missing" / ("x" * 20) / "..", "OUT_DIR") is None
