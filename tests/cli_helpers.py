"""Run the real CLI the way a user does, and read its `--json` report.

The one runner (`run_cli`) and the one parser (`json_problems`) every test and fault
scenario goes through: a subprocess by default (exit codes, signals and resource limits as
a user meets them), or in this process through click's runner where speed matters and the
process boundary is not the point (`inprocess=True`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import click

ENTRY = [sys.executable, "-m", "kimi_w31"]  # the console entry point, as installed
# What the `kimi-convert` console script runs, for a run that needs Python run first.
SCRIPT = "from kimi_w31.cli import main; main(prog_name='kimi-convert')"


@dataclass(frozen=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    exception: BaseException | None = None  # in-process: an exception the CLI let escape

    @property
    def output(self) -> str:
        """Everything the user saw: stdout, then stderr."""
        return self.stdout + self.stderr

    @property
    def json(self) -> Any:
        """stdout as JSON (a `--json` report), or None when it is not JSON."""
        try:
            return json.loads(self.stdout)
        except ValueError:
            return None

    @property
    def problems(self) -> list[dict]:
        return json_problems(self.stdout)

    @property
    def codes(self) -> list[str]:
        """The reported reason codes, in report order."""
        return [p.get("code") for p in self.problems]


def json_problems(text: str) -> list[dict]:
    """The problems a `--json` run reported (empty if it printed no JSON report): convert's
    top-level `problems`, then each of verify's `checks`' problems."""
    try:
        doc = json.loads(text)
    except ValueError:
        return []
    if not isinstance(doc, dict):
        return []
    found = list(doc.get("problems") or [])
    for check in doc.get("checks") or []:
        found += check.get("problems") or []
    return found


def cli_env(env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This environment without the tool's own knobs, one problem a line whatever the
    terminal, then `env` on top (a None value removes the variable)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_W31_")}
    full["COLUMNS"] = "200"
    for key, value in (env or {}).items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    return full


def cli_argv(args: Iterable[object], prelude: str | None = None) -> list[str]:
    """The command line of a subprocess run; with `prelude`, that Python runs first in the
    process (a test hook, e.g. to scale a library constant down) and then the CLI."""
    entry = ENTRY if prelude is None else [sys.executable, "-c", prelude + SCRIPT]
    return [*entry, *map(str, args)]


def ctrl_c_as_at_a_terminal() -> None:
    """A child's SIGINT back to its default: a runner started in the background by a
    non-interactive shell (`make test &`, nohup) ignores SIGINT, its children inherit that,
    and Python keeps an ignored SIGINT ignored, so a test's Ctrl-C would never arrive."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(
    args: Iterable[object],
    *,
    inprocess: bool = False,
    prelude: str | None = None,
    command: click.Command | None = None,
    env: Mapping[str, str | None] | None = None,
    preexec_fn: Callable[[], None] | None = None,
    cwd: os.PathLike | str | None = None,
    timeout: float = 120,
    check: bool = False,
    **invoke: Any,
) -> CliResult:
    """The CLI on `args`. In a subprocess by default (see `cli_argv` for `prelude`; `env`
    as in `cli_env`); `inprocess=True` runs `command` (default: the `kimi-convert` group)
    through click's runner, `invoke` passed on to it."""
    argv = [str(a) for a in args]
    if inprocess:
        assert prelude is None and preexec_fn is None and cwd is None, "a subprocess's options"
        from click.testing import CliRunner

        from kimi_w31.cli import main

        env_over = {"COLUMNS": "200", **(env or {})}
        got = CliRunner().invoke(command or main, argv, env=env_over, **invoke)
        exc = got.exception if not isinstance(got.exception, SystemExit) else None
        result = CliResult(got.exit_code, got.stdout, got.stderr, exc)
    else:
        assert command is None and not invoke, "a subprocess runs the console entry point"
        proc = subprocess.run(
            cli_argv(argv, prelude),
            env=cli_env(env),
            preexec_fn=preexec_fn or ctrl_c_as_at_a_terminal,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        result = CliResult(proc.returncode, proc.stdout, proc.stderr)
    if check and result.returncode != 0:
        raise AssertionError(f"exit {result.returncode}\n{result.stdout}\n{result.stderr}")
    return result


def start_cli(
    args: Iterable[object], *, stop_at: str, env: Mapping[str, str | None] | None = None
) -> subprocess.Popen:
    """The CLI in a subprocess held stopped (SIGSTOP) at fault point `stop_at`: for a test
    that must act while the run is in flight (signal it, race it). Returns the Popen once it
    has stopped; resume it with SIGCONT and `communicate()`."""
    proc = subprocess.Popen(
        cli_argv(args),
        env=cli_env({**(env or {}), "KIMI_W31_FAULT_AT": stop_at + ":stop"}),
        preexec_fn=ctrl_c_as_at_a_terminal,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    _, status = os.waitpid(proc.pid, os.WUNTRACED)
    if not os.WIFSTOPPED(status):
        raise RuntimeError(f"the run ended before reaching {stop_at}")
    return proc
