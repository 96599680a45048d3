"""Path arguments the OS refuses to look up (too long, a link loop), for every path
parameter of every command: the argument's problem (`path-unusable`), exit 2, and with
`--json` a document."""

from __future__ import annotations

import json
from pathlib import Path

import click
from cli_helpers import json_problems, run_cli
from kimi_w31.converter.cli.arguments import PathArg
from kimi_w31.converter.errors import EXIT_USAGE
from kimi_w31.converter.reasons import Code

from .core import CLEAN, CRASH, WRONG, Case, looks_like_crash

FAULT = "path arguments"


def _hostile(tmp: Path) -> dict[str, str]:
    (tmp / "loopA").symlink_to("loopB")
    (tmp / "loopB").symlink_to("loopA")
    return {
        "name too long": str(tmp / ("n" * 300)),
        "path too long": str(tmp / "/".join(["p" * 200] * 25)),
        "link loop": str(tmp / "loopA"),
        "link loop on the way": str(tmp / "loopA" / "x"),
    }


def argument_cases(template: Path, work: Path) -> list[Case]:
    from kimi_w31.cli import main

    work.mkdir(parents=True, exist_ok=True)
    values = _hostile(work)
    rows = []
    for name in main.list_commands(click.Context(main)):
        command = main.get_command(click.Context(main), name)
        has_json = any(isinstance(p, click.Option) and "--json" in p.opts for p in command.params)
        for param in command.params:
            if not isinstance(param.type, PathArg):
                continue
            label = param.opts[0] if isinstance(param, click.Option) else param.metavar
            for case, value in values.items():
                argv = [name]
                for p in command.params:
                    if isinstance(p, click.Argument) and p.nargs == 1:
                        argv.append(value if p is param else str(template))
                if isinstance(param, click.Option):
                    argv += [param.opts[0], value]
                argv += ["--json"] if has_json else []
                run = run_cli(argv, inprocess=True)
                text = run.stdout + run.stderr
                row = f"{name} {label}: {case}"
                crashed = looks_like_crash(text) or not (
                    run.exception is None or isinstance(run.exception, SystemExit)
                )
                if crashed:
                    rows.append(Case(FAULT, row, CRASH, " ".join(text.split())[-200:]))
                    continue
                codes = [p.get("code") for p in json_problems(run.stdout)]
                documented = not has_json or (
                    codes == [Code.PATH_UNUSABLE.value]
                    and json.loads(run.stdout).get("exit_code") == EXIT_USAGE
                )
                named = label in text
                if run.returncode != EXIT_USAGE or not documented or not named:
                    rows.append(Case(FAULT, row, WRONG, f"exit {run.returncode}: {text[-160:]}"))
                else:
                    said = json_problems(run.stdout)[0]["what"] if has_json else text
                    said = " ".join(said.split())
                    rows.append(Case(FAULT, row, CLEAN, f"[path-unusable] {said[:120]}"))
    return rows
