"""Deterministic fault injection for the crash tests; inert unless asked for.

`KIMI_W31_FAULT_AT=<label>:<n>[:<action>]` makes the n-th call (1-based, counted per
process) of `fault_point(label)` act: `kill` (default) sends SIGKILL to this process, `int`
sends SIGINT (what Ctrl-C does), `stop` sends SIGSTOP (the process stays alive, holding its
lock, until the test sends SIGCONT: how a test changes the source mid-run). Tests use it to
stop a real conversion at an exact point (after a shard header, between the two halves of a
w31, around a ledger append, between the finishing writes) instead of guessing with sleeps.
With the variable unset a call is one global load and a comparison.
"""

from __future__ import annotations

import os
import signal
import threading

ENV = "KIMI_W31_FAULT_AT"


def _parse(spec: str | None) -> tuple[str, int, str] | None:
    if not spec:
        return None
    label, _, rest = spec.partition(":")
    count, _, action = rest.partition(":")
    return label, int(count or 1), action or "kill"


_SPEC = _parse(os.environ.get(ENV))
_counts: dict[str, int] = {}
_lock = threading.Lock()


def fault_point(label: str) -> None:
    if _SPEC is None or _SPEC[0] != label:
        return
    with _lock:  # workers reach the same label concurrently; count each call once
        _counts[label] = n = _counts.get(label, 0) + 1
    if n == _SPEC[1]:
        sig = {"int": signal.SIGINT, "stop": signal.SIGSTOP}.get(_SPEC[2], signal.SIGKILL)
        os.kill(os.getpid(), sig)
