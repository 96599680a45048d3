"""Run the real CLI the way a user does."""

from __future__ import annotations

import subprocess
import sys


def run_cli(*args: str, check: bool = False, **kw) -> subprocess.CompletedProcess:
    """The real console entry point in a subprocess: exit codes and output as a user sees."""
    proc = subprocess.run(
        [sys.executable, "-m", "kimi_w31", *map(str, args)],
        capture_output=True,
        text=True,
        **kw,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc
