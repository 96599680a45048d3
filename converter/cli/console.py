"""How the commands talk to people: errors, sizes, progress, exit codes.

Exit codes come from each reason's record (`errors.reason(code).exit`): a reason exits the
same in every command and in `--json` (0 success, 1 invalid input or a failed check, 2 usage
error, 130 interrupted (Ctrl-C), 143 terminated (SIGTERM)). Progress goes to stderr as a
live bar on a terminal and as a plain line at a steady interval anywhere else (`nohup`, CI,
`| tee`, a scheduler's log), so a log shows where a multi-hour job is.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import click
from rich.console import Console
from rich.markup import escape

from ..errors import (
    EXIT_BUG,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    Fatal,
    Problem,
    count_codes,
    reason,
    root_problems,
)
from ..reasons import Code
from ..text import duration, human, id_ranges, plural  # noqa: F401  (the CLI's names for them)
from .arguments import PROGRESS_MODES, progress_option, resolve_params  # noqa: F401

err = Console(stderr=True, soft_wrap=True, highlight=False)  # no hard wraps: greppable
out = Console(soft_wrap=True, highlight=False)

LINE_INTERVAL_ENV = "KIMI_W31_PROGRESS_INTERVAL"  # seconds between plain progress lines

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str) -> int:
    """'500MB', '5GB', '4GiB' -> bytes; a positive size or a usage error."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m[2].upper() not in _UNITS:
        raise click.BadParameter(
            f"size {text!r} not understood; use a number with a unit such as 500MB, 5GB or 4GiB"
        )
    value = int(float(m[1]) * _UNITS[m[2].upper()])
    if value <= 0:
        raise click.BadParameter(f"size {text!r} must be more than 0 bytes")
    return value


def problems_json(problems: list[Problem], **extra: object) -> dict:
    """The `--json` form of a failure: the causes, how many problems follow from them (not
    listed), and the exit code, as the table gives it."""
    roots, suppressed = root_problems(problems)
    return {
        "ok": False,
        "exit_code": Fatal(problems).exit_code,
        "problems": [p.as_dict() for p in roots],
        "suppressed": len(suppressed),
        "suppressed_codes": count_codes(suppressed),
        **extra,
    }


def suppressed_line(suppressed: list[Problem]) -> str:
    """'3 more problems follow from the above, not listed: layer-unexpected x2, ...'."""
    counts = ", ".join(
        code + (f" x{n}" if n > 1 else "") for code, n in count_codes(suppressed).items()
    )
    n = len(suppressed)
    verb = "follows" if n == 1 else "follow"
    return f"{plural(n, 'more problem')} {verb} from the above, not listed: {counts}"


def render_error(exc: Fatal, as_json: bool) -> None:
    if as_json:
        out.print_json(json.dumps(problems_json(exc.problems, hint=exc.hint)))
        return
    roots, suppressed = root_problems(exc.problems)
    err.print(f"[bold red]error:[/] {escape(exc.summary())}")
    shown = roots[:50]
    if len(roots) > 1:  # one problem is the summary line itself
        for p in shown:
            err.print(f"  [red]-[/] {escape(p.render())}")
        if len(roots) > len(shown):
            err.print(f"  ... and {len(roots) - len(shown)} more")
    if suppressed:
        err.print(f"  ({escape(suppressed_line(suppressed))})")
    if exc.hint:
        err.print(f"[yellow]hint:[/] {escape(exc.hint)}")


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: every worker stops at its next chunk, state is kept."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def run_guarded(
    fn: Callable[[], None], as_json: bool = False, interrupted: str = "interrupted."
) -> None:
    """Run a command body; turn errors into messages and exit codes, never tracebacks.

    `interrupted` is what Ctrl-C or SIGTERM leaves behind, in the command's own words.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        # Every path argument looked up first: one the OS refuses is the argument's problem.
        resolve_params(click.get_current_context(silent=True))
        fn()
    except Fatal as exc:
        # The frames it was raised through hold the plan (~2M objects) in a cycle with the
        # error itself: cleared, they are freed now rather than by a collection at exit.
        traceback.clear_frames(exc.__traceback__)
        render_error(exc, as_json)
        sys.exit(exc.exit_code)
    except click.UsageError as exc:
        exc.show()
        sys.exit(reason(Code.USAGE).exit)
    except KeyboardInterrupt as exc:
        code = EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
        what = "terminated (SIGTERM)" if code == EXIT_TERMINATED else "interrupted"
        err.print(f"[yellow]{what}:[/] {escape(interrupted)}")
        sys.exit(code)
    except click.exceptions.Exit:
        raise
    except Exception as exc:  # a bug or an unexpected OS error: say what, not a traceback
        if os.environ.get("KIMI_W31_DEBUG"):
            raise
        err.print(f"[bold red]error:[/] {type(exc).__name__}: {escape(str(exc))}")
        err.print("set KIMI_W31_DEBUG=1 for the full traceback")
        sys.exit(EXIT_BUG)


def guard_paths(as_json: bool = False) -> None:
    """The running command's path arguments judged (`arguments.resolve_params`), for a
    command that does not run under `run_guarded`: a refusal is printed as run_guarded
    prints one (its JSON document with `as_json`), and the process exits with its code."""
    try:
        resolve_params(click.get_current_context(silent=True))
    except Fatal as exc:
        render_error(exc, as_json=as_json)
        sys.exit(exc.exit_code)


def same_stream(a: int = 1, b: int = 2) -> bool:
    """Whether file descriptors `a` and `b` write to the same file (`2>&1`, a terminal)."""
    try:
        sa, sb = os.fstat(a), os.fstat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def resolve_mode(
    mode: str,
    quiet: bool = False,
    as_json: bool = False,
    shared: Callable[[], bool] = same_stream,
) -> str:
    """The progress display for `--progress mode`. Progress always goes to stderr, so with
    --json (on stdout) it is kept when asked for, and by default when stderr is not the
    same file as the JSON (a script reading stdout, a log tailed from stderr); on a shared
    stream it would interleave with the JSON, so `auto` shows none there."""
    if quiet:
        return "none"
    if mode == "auto":
        if as_json and shared():
            return "none"
        return "bar" if err.is_terminal else "lines"
    return mode


class Progress:
    """One measured quantity (bytes, or items) with a total, an ETA and a few counters.

    `bar`: a live bar on the terminal. `lines`: a plain line every interval (default 30 s)
    and at each tenth of the work, then a final line. `none`: nothing. Thread-safe.
    """

    def __init__(
        self,
        mode: str,
        label: str,
        total: int | None,
        unit: str = "bytes",
        interval: float | None = None,
    ) -> None:
        self.mode = mode
        self.label = label
        self.total = total
        self.unit = unit
        self.done = 0
        self.moved = 0  # what this run read or wrote (for the rate); `done` may include kept
        self.notes: dict[str, str] = {}
        self.started = time.monotonic()
        self.stopped_at: float | None = None
        self.interval = (
            interval if interval is not None else float(os.environ.get(LINE_INTERVAL_ENV, "30"))
        )
        self._lock = threading.Lock()
        self._next_tenth = 1
        self._last_line = self.started
        self._lines = 0  # plain lines printed so far
        self._bar = None
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if mode == "bar":
            from rich.progress import BarColumn, TextColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn(f"[bold]{escape(label)}"),
                BarColumn(),
                TextColumn("{task.fields[status]}"),
                console=err,
                transient=False,
            )
            self._task = self._bar.add_task(label, total=total, status="")
            self._bar.start()
        elif mode == "lines":
            self._ticker = threading.Thread(target=self._tick, name="progress", daemon=True)
            self._ticker.start()

    def advance(self, n: int, moved: bool = True) -> None:
        self.add(n, n if moved else 0)

    def add(self, done: int, moved: int) -> None:
        """`done`: how much further the work got; `moved`: bytes this run read or wrote for
        it (the rate). They differ when proving a kept shard re-reads it."""
        with self._lock:
            self.done += done
            self.moved += moved
        self._refresh()

    def note(self, **notes: str) -> None:
        with self._lock:
            self.notes.update(notes)
        self._refresh()

    def status(self) -> str:
        with self._lock:
            done, total, moved = self.done, self.total, self.moved
            notes = "; ".join(f"{k} {v}" for k, v in self.notes.items())
        elapsed = self.elapsed()
        fmt = human if self.unit == "bytes" else str
        parts = [f"{fmt(done)}/{fmt(total) if total is not None else '?'}"]
        if total:
            parts[0] += f" ({100 * done / total:.0f}%)"
        rate = moved / elapsed
        if self.unit == "bytes":
            parts.append(f"{human(rate)}/s")
        if total and rate > 0 and done < total:
            parts.append(f"ETA {duration((total - done) / rate)}")
        parts.append(f"elapsed {duration(elapsed)}")
        return ", ".join(parts) + (f"; {notes}" if notes else "")

    def elapsed(self) -> float:
        """Seconds from the start to now, or to `stop()` once stopped."""
        end = self.stopped_at if self.stopped_at is not None else time.monotonic()
        return max(end - self.started, 1e-6)

    def rate(self) -> float:
        """What this run moved per second: the figure the lines show, and the summary too."""
        with self._lock:
            moved = self.moved
        return moved / self.elapsed()

    def _refresh(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, status=self.status())
        elif self.mode == "lines" and self.total:
            # A line at each tenth of the work too, but never more than one a second.
            with self._lock:
                due = self.done * 10 >= self.total * self._next_tenth and self.done < self.total
                if due:
                    self._next_tenth = self.done * 10 // self.total + 1
                    due = time.monotonic() - self._last_line >= 1.0
            if due:
                self._line()

    def _tick(self) -> None:
        while not self._stop.wait(min(self.interval, 1.0)):
            if time.monotonic() - self._last_line >= self.interval:
                self._line()

    def _line(self) -> None:
        self._last_line = time.monotonic()
        self._lines += 1
        err.print(f"{self.label}: {self.status()}", markup=False)

    def stop(self) -> None:
        """The final state; nothing at all when the work never started (a run refused
        before its first byte shows the refusal, not a 0 % line above it)."""
        if self.stopped_at is None:
            self.stopped_at = time.monotonic()
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        silent = self.done == 0 and self.moved == 0
        if self._bar is not None:
            if silent:
                self._bar.remove_task(self._task)
            else:
                self._bar.update(self._task, completed=self.done, status=self.status())
            self._bar.stop()
        elif self.mode == "lines" and not (silent and self._lines == 0):
            self._line()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
