"""How a long check reports its progress: through a factory the caller passes (the command
line gives one that draws a bar or prints lines), as the pipeline reports through its
`Reporter`. The audit itself imports no UI."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Protocol


class Meter(Protocol):
    def advance(self, n: int) -> None: ...
    def note(self, **notes: str) -> None: ...


# (label, total, unit) -> a context manager giving a Meter
MeterFactory = Callable[[str, int | None, str], AbstractContextManager[Meter]]


class _Silent:
    def advance(self, n: int) -> None:
        pass

    def note(self, **notes: str) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def silent(label: str, total: int | None, unit: str = "bytes") -> _Silent:
    """The default: no progress shown."""
    return _Silent()
