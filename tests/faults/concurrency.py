"""Concurrent runs on one output directory, and the lock itself."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from cli_helpers import json_problems, run_cli, start_cli
from kimi_w31.converter.reasons import Code

from .core import (
    CLEAN,
    CORRECT,
    CRASH,
    RESUMED,
    STATE,
    WRONG,
    Case,
    convert_args,
    copy_source,
    looks_like_crash,
    reference_output,
    resume_stopped,
    tree,
)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def concurrency_cases(template: Path, work: Path) -> list[Case]:
    import socket

    src = copy_source(template, work / "src")
    ref = reference_output(src, work / "ref")
    host = socket.gethostname()
    rows = []

    # A live run stopped mid-shard holds the lock: a second run, even --force with another
    # plan, must refuse naming pid and host, delete nothing; the first then completes.
    out = work / "live"
    first = start_cli(convert_args(src, out, "--workers", "1"), stop_at="shard.renamed:3")
    try:
        held = tree(out)
        for name, extra in [
            ("second run, same command", []),
            ("second run, --force and another plan", ["--force", "--max-shard-size", "500KB"]),
        ]:
            proc = run_cli(convert_args(src, out, "--workers", "1", "--json", *extra))
            owner = [
                p["what"]
                for p in json_problems(proc.stdout)
                if p.get("code") == Code.OUTPUT_LOCKED.value
            ]
            good = (
                proc.returncode == 1
                and owner
                and f"pid {first.pid}" in owner[0]
                and host in owner[0]
                and tree(out) == held
            )
            outcome = CRASH if looks_like_crash(proc.stderr) else CLEAN if good else WRONG
            rows.append(Case("concurrent runs", name, outcome, (owner or [proc.stdout])[0][:160]))
    finally:
        code, err, _ = resume_stopped(first)
    got = tree(out)
    rows.append(
        Case(
            "concurrent runs",
            "first run completes after the refusals",
            RESUMED if code == 0 and got == ref else WRONG,
            "" if code == 0 and got == ref else f"exit {code}: {err[-200:]}",
        )
    )

    # Stale lock (dead pid, this host): taken over with a warning.
    out = work / "stale"
    (out / STATE).mkdir(parents=True)
    (out / STATE / "lock").write_text(json.dumps({"pid": _dead_pid(), "host": host}))
    proc = run_cli(convert_args(src, out, "--workers", "1", "--json"))
    warnings = proc.json.get("warnings") if proc.returncode == 0 else None
    ok = proc.returncode == 0 and warnings and tree(out) == ref
    rows.append(
        Case(
            "concurrent runs",
            "stale lock of a dead pid taken over",
            RESUMED if ok else WRONG,
            str(warnings)[:160] if ok else proc.stderr[-160:],
        )
    )

    # A lock from another host cannot be judged stale from here: refuse, name the owner.
    out = work / "remote"
    (out / STATE).mkdir(parents=True)
    (out / STATE / "lock").write_text(json.dumps({"pid": 4242, "host": "node-b17"}))
    proc = run_cli(convert_args(src, out, "--workers", "1", "--json"))
    owner = [
        p["what"] for p in json_problems(proc.stdout) if p.get("code") == Code.OUTPUT_LOCKED.value
    ]
    good = proc.returncode == 1 and owner and "pid 4242 on node-b17" in owner[0]
    rows.append(
        Case(
            "concurrent runs",
            "lock held on another host",
            CLEAN if good else WRONG,
            (owner or [proc.stdout])[0][:160],
        )
    )
    return rows


def lock_race_cases(template: Path, work: Path) -> list[Case]:
    """The lock itself, in-process: a takeover in progress elsewhere, and corrupt content."""
    import fcntl
    import socket

    from kimi_w31.converter.errors import Fatal
    from kimi_w31.converter.output.lock import OutputLock

    rows = []
    work.mkdir(parents=True, exist_ok=True)
    path = work / "lock"
    path.write_text(json.dumps({"pid": _dead_pid(), "host": socket.gethostname()}))
    # Another run is taking over this stale lock right now (it holds the flock): refuse.
    other = os.open(path, os.O_RDWR)
    fcntl.flock(other, fcntl.LOCK_EX)
    try:
        OutputLock(path).acquire()
        rows.append(
            Case(
                "concurrent runs",
                "two runs take over one stale lock",
                WRONG,
                "both would hold the lock",
            )
        )
    except Fatal as exc:
        rows.append(
            Case(
                "concurrent runs",
                "two runs take over one stale lock",
                CLEAN,
                exc.problems[0].render()[:160],
            )
        )
    finally:
        os.close(other)  # that run died too: now the lock is ours to take
    lock = OutputLock(path)
    lock.acquire()
    ours = json.loads(path.read_text())["pid"] == os.getpid() and lock.warning
    lock.release()
    rows.append(
        Case(
            "concurrent runs",
            "stale lock taken over once the other taker is gone",
            CORRECT if ours and not path.exists() else WRONG,
            str(lock.warning),
        )
    )
    for name, content in [
        ("lock file with a non-integer pid", '{"pid": "x", "host": "h"}'),
        ("lock file that is not JSON", "\0\0garbage"),
        ("lock file naming pid -1", json.dumps({"pid": -1, "host": socket.gethostname()})),
    ]:
        path.write_text(content)
        try:
            OutputLock(path).acquire()
            rows.append(Case("concurrent runs", name, WRONG, "taken over"))
        except Fatal as exc:
            rows.append(Case("concurrent runs", name, CLEAN, exc.problems[0].render()[:160]))
        except Exception as exc:  # the point is to classify anything else
            rows.append(Case("concurrent runs", name, CRASH, f"{type(exc).__name__}: {exc}"))
    return rows
